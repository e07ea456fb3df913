"""HTTP handlers of the router. Every client mistake is a JSON 4xx, never a 500."""
from __future__ import annotations

import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from router.appkeys import DISPATCHER, STATE
from router.config import parse_bootstrap_port
from router.dispatch import HOP_HEADERS, json_error
from router.policy import RouteContext
from router.requests import CHAT, COMPLETIONS, GENERATE, PARSERS, BadRequest, load_json, parse_any
from router.state import NoWorkers, UnknownModel
from router.workers import DECODE, PREFILL, ROLES

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_label(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    resource = getattr(route, "resource", None)
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        return resp
    except web.HTTPRequestEntityTooLarge:
        status = 413
        limit = request.app[STATE].config.max_body
        return json_error(413, f"body too large: the limit is {limit} bytes (router --max-body)")
    except web.HTTPException as exc:
        status = exc.status
        if exc.status < 400:
            raise
        return json_error(exc.status, exc.reason)
    except Exception:  # noqa: BLE001 - the router answers, whatever happened
        logger.exception("unexpected error on %s %s", request.method, request.path)
        return json_error(500, "internal router error (see the router log)")
    finally:
        m = request.app[STATE].metrics
        m.child(m.requests, _route_label(request), str(status)).inc()


def request_id_of(request: web.Request) -> str:
    rid = request.headers.get("x-request-id", "")
    if 0 < len(rid) <= 256 and rid.isprintable():
        return rid
    # Not a secret, only unique: a PRNG draw avoids a syscall per request.
    return f"{random.getrandbits(128):032x}"


def forward_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {"content-type": "application/json", "x-request-id": request_id}
    for name in HOP_HEADERS:
        value = request.headers.get(name)
        if value is not None and name != "x-request-id":
            headers[name] = value
    return headers


async def _raw(request: web.Request) -> bytes:
    limit = request.app[STATE].config.max_body
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    return await request.read()


async def _body(request: web.Request) -> dict[str, Any]:
    return load_json(await _raw(request))


async def _proxy(request: web.Request, kind: str, path: str) -> web.StreamResponse:
    state = request.app[STATE]
    rid = request_id_of(request)
    try:
        raw = await _raw(request)
        parsed = PARSERS[kind](load_json(raw), state.config.max_tokens)
        parsed.raw = raw
        state.check_model(parsed.model)
    except BadRequest as exc:
        return json_error(exc.status, str(exc), rid)
    except UnknownModel as exc:
        return json_error(404, str(exc), rid)
    return await request.app[DISPATCHER].forward(request, path, path, parsed,
                                                 forward_headers(request, rid), rid)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, GENERATE, "/generate")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, COMPLETIONS, "/v1/completions")


async def chat(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, CHAT, "/v1/chat/completions")


async def debug_route(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        parsed = parse_any(await _body(request), state.config.max_tokens)
        state.check_model(parsed.model)
    except BadRequest as exc:
        return json_error(exc.status, str(exc))
    except UnknownModel as exc:
        return json_error(404, str(exc))
    t0 = time.perf_counter()
    try:
        ctx = RouteContext(parsed.prompts[0], parsed.model or state.config.model)
        pair = state.select_pair(ctx)
    except NoWorkers as exc:
        return json_error(503, str(exc), role=exc.role)
    p, d = pair.prefill, pair.decode
    return web.json_response({
        "prefill": {"instance_id": p.worker.instance_id, "url": p.worker.url,
                    "bootstrap_host": p.worker.bootstrap_host,
                    "bootstrap_port": p.worker.bootstrap_port},
        "decode": {"instance_id": d.worker.instance_id, "url": d.worker.url},
        "policy": {"prefill": state.prefill_policy.name, "decode": state.decode_policy.name},
        "prompt_tokens": len(parsed.prompts[0]), "prompt_blocks": p.prompt_blocks,
        "matched_blocks": p.matched_blocks, "block_size": state.config.block_size,
        "candidates": p.candidates, "decision_us": round((time.perf_counter() - t0) * 1e6, 1),
        "index": state.index_detail(),
    })


async def models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    now = int(state.started_at)
    return web.json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": now, "owned_by": "kvatlas"}
        for m in sorted(state.pools.models())]})


async def health(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "ok"})


async def liveness(request: web.Request) -> web.StreamResponse:
    return web.json_response({"status": "alive"})


async def readiness(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    detail: dict[str, Any] = {}
    ready = True
    for role in ROLES:
        workers = state.pools.pool(role)
        available = sum(1 for w in workers if w.available)
        detail[role] = {"total": len(workers), "available": available}
        if not available:
            ready = False
            detail[role]["reason"] = state.pools.unavailable_reason(role)
    detail["index"] = state.index_detail()
    detail["status"] = "ready" if ready else "not ready"
    return web.json_response(detail, status=200 if ready else 503)


async def list_workers(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    return web.json_response({role: [w.describe() for w in state.pools.pool(role)]
                              for role in ROLES})


def _check_admin(request: web.Request) -> web.Response | None:
    token = request.app[STATE].config.admin_token
    if token is None:
        return json_error(403, "worker administration is disabled: start the router with "
                               "--admin-token")
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        return json_error(401, "missing or wrong admin token (Authorization: Bearer TOKEN)")
    return None


async def _admin_args(request: web.Request) -> dict[str, Any]:
    args: dict[str, Any] = dict(request.query)
    if request.can_read_body:
        args.update(await _body(request))
    return args


async def add_worker(request: web.Request) -> web.StreamResponse:
    denied = _check_admin(request)
    if denied is not None:
        return denied
    state = request.app[STATE]
    try:
        args = await _admin_args(request)
        role = args.get("role", args.get("worker_type", PREFILL))
        if role not in ROLES:
            raise BadRequest("role", f"must be one of {list(ROLES)}")
        url = args.get("url")
        if not isinstance(url, str):
            raise BadRequest("url", "is missing (http://HOST:PORT)")
        iid = args.get("instance_id")
        if iid is not None and not isinstance(iid, str):
            raise BadRequest("instance_id", "must be a string")
        port = parse_bootstrap_port(args.get("bootstrap_port")) if role == PREFILL else None
        worker = state.pools.add(role, url, instance_id=iid, bootstrap_port=port,
                                 model=state.config.model, source="admin")
    except BadRequest as exc:
        return json_error(400, str(exc))
    except ValueError as exc:
        return json_error(400, str(exc))
    return web.json_response(worker.describe(), status=201)


async def delete_worker(request: web.Request) -> web.StreamResponse:
    denied = _check_admin(request)
    if denied is not None:
        return denied
    state = request.app[STATE]
    try:
        args = await _admin_args(request)
    except BadRequest as exc:
        return json_error(400, str(exc))
    url, iid = args.get("url"), args.get("instance_id")
    if isinstance(iid, str):
        gone = [w for w in (state.pools.remove(r, iid) for r in (PREFILL, DECODE)) if w]
    elif isinstance(url, str):
        gone = state.pools.remove_url(url)
    else:
        return json_error(400, "give url or instance_id (query or JSON body)")
    if not gone:
        return json_error(404, f"no worker with {'instance_id' if iid else 'url'} "
                               f"{iid or url!r}")
    return web.json_response({"removed": [w.describe() for w in gone]})


async def metrics(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.refresh_gauges()
    return web.Response(body=state.metrics.render(),
                        headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})
