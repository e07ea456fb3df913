"""HTTP handlers of the router. Every client mistake is a JSON 4xx, never a 500."""
from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from router.admission import Admission
from router.client_ids import client_rid, new_request_id
from router.config import parse_bootstrap_port
from router.dispatch import HOP_HEADERS, Dispatcher
from router.engine_load import check_disagg_tokens, check_thresholds
from router.errors import BadRequest, RouterError, error_response, json_error
from router.http.server import Request, Response, Stream, json_response
from router.json_body import load_json
from router.requests import ANY, CHAT, COMPLETIONS, GENERATE, Parsed, parse_body
from router.route import decide, route_context
from router.state import RouterState
from router.workers import ADMIN, AGGREGATED, DECODE, PREFILL, ROLES

logger = logging.getLogger(__name__)


@dataclass
class Services:
    """What the handlers work with."""

    state: RouterState
    dispatcher: Dispatcher
    admission: Admission


def _usable_id(value: str) -> bool:
    """Fit to be a request id: it goes into log lines and a response header as it is."""
    return 0 < len(value) <= 256 and value.isascii() and value.isprintable()


def given_request_id(request: Request,
                     names: tuple[str, ...] = ("x-request-id",)) -> str | None:
    """The client's request id from the first of ``names`` it sent (None: it sent none)."""
    headers = request.headers
    for name in names:
        rid = headers.get(name, "")
        if _usable_id(rid):
            return rid
    return None


CLIENT_AUTH_HEADERS = ("authorization", "cookie")
# The headers a worker may get, with and without the client's credentials (decided once here,
# not per header of every request).
_FORWARDED_WITH_AUTH = tuple(n for n in (*HOP_HEADERS, "cookie") if n != "x-request-id")
_FORWARDED = tuple(n for n in _FORWARDED_WITH_AUTH if n not in CLIENT_AUTH_HEADERS)
"""The client's credentials: forwarded only with ``RouterConfig.forward_client_auth``."""


def forward_headers(request: Request, request_id: str,
                    client_auth: bool = False) -> dict[str, str]:
    """The headers the workers get: the request id, the trace context and, with
    ``client_auth``, the client's credentials (``CLIENT_AUTH_HEADERS``). Without it they stay
    here: a worker is whatever URL an etcd record names."""
    headers = {"content-type": "application/json", "x-request-id": request_id}
    for name in _FORWARDED_WITH_AUTH if client_auth else _FORWARDED:
        value = request.headers.get(name)
        if value is not None:
            headers[name] = value
    return headers


async def _proxy(svc: Services, request: Request, kind: str,
                 path: str) -> Response | Stream:
    state = svc.state
    given = given_request_id(request, state.config.request_id_headers)
    rid = given or new_request_id()
    admission = svc.admission
    limited = admission.limit > 0  # without a limit nothing is counted
    try:
        parsed = await _parse(state, kind, request.body)
        crid = client_rid(parsed.body, parsed.batch)
        state.check_model(parsed.model)
        if parsed.load_only:
            state.tokenizers.note_load_only(parsed.route_model)
        if crid is not None and given is None and isinstance(crid, str) and _usable_id(crid):
            # The client's own id names the request in logs and comes back in x-request-id;
            # the engines get a unique one instead (router.client_ids).
            rid = crid
        if limited:
            await admission.enter()
    except RouterError as exc:  # bad body, unknown model, no slot: answered with the id
        return error_response(exc, rid)
    try:
        return await svc.dispatcher.forward(request, path, path, parsed,
                                            forward_headers(request, rid,
                                                            state.config.forward_client_auth),
                                            rid, crid)
    except RouterError as exc:  # no worker with room (router/capacity.py): with the id
        return error_response(exc, rid)
    finally:
        if limited:
            admission.leave()


def _parse(state: RouterState, kind: str, raw: bytes) -> Awaitable[Parsed]:
    tokenizers = state.tokenizers
    return parse_body(kind, raw, state.config.max_tokens, state.pools.limits,
                      state.config.block_size, tokenizers, tokenizers.off_loop_bytes)


async def generate(svc: Services, request: Request) -> Response | Stream:
    return await _proxy(svc, request, GENERATE, "/generate")


async def completions(svc: Services, request: Request) -> Response | Stream:
    return await _proxy(svc, request, COMPLETIONS, "/v1/completions")


async def chat(svc: Services, request: Request) -> Response | Stream:
    return await _proxy(svc, request, CHAT, "/v1/chat/completions")


async def debug_route(svc: Services, request: Request) -> Response:
    """The decision a request would get, sent nowhere. Besides the pick: the prompt's token
    count, per candidate the blocks the index shows (``index_blocks``) and those only the
    router's prediction holds (``predicted_blocks``), the tokenizer used (None: the model has
    none here, ``load_only``); with ``"return_token_ids": true``, the prompt's ``token_ids``."""
    state = svc.state
    parsed = await _parse(state, ANY, request.body)
    state.check_model(parsed.model)
    want_ids = parsed.body.get("return_token_ids") is True
    decision = decide(state, route_context(parsed),
                      unfit=state.pools.limits.unfit(parsed.prompts, len(request.body)))
    model = decision.model
    tokens = parsed.prompts[0]
    answer: dict[str, Any] = decision.describe(state)
    answer.update({
        "tokenizer": state.tokenizers.describe(model) if parsed.from_text else None,
        "load_only": (f"no tokenizer is known for model {model or '(none)'}: the text is "
                      "routed on load alone") if parsed.load_only else None,
        "prompt_tokens": None if parsed.load_only else len(tokens),
        "index": state.index_detail(),
    })
    if want_ids:
        answer["token_ids"] = None if parsed.load_only else [int(t) for t in tokens]
    return json_response(answer)


async def index_health(svc: Services, request: Request) -> Response:
    """Per worker: the requests it served, the blocks the index holds of it, whether its
    entries are ignored (and why) and its canaries; with the router's block size and seed."""
    return json_response(svc.state.index_health())


async def models(svc: Services, request: Request) -> Response:
    state = svc.state
    now = int(state.started_at)
    return json_response({"object": "list", "data": [
        {"id": m, "object": "model", "created": now, "owned_by": "kvatlas"}
        for m in sorted(state.pools.models())]})


async def health(svc: Services, request: Request) -> Response:
    return json_response({"status": "ok"})


async def liveness(svc: Services, request: Request) -> Response:
    return json_response({"status": "alive"})


async def readiness(svc: Services, request: Request) -> Response:
    state = svc.state
    detail: dict[str, Any] = {}
    can: dict[str, bool] = {}
    for role in ROLES:
        workers = [w for w in state.pools.pool(role) if w.counted]
        available = sum(1 for w in workers if w.available)
        can[role] = available > 0
        detail[role] = {"total": len(workers), "available": available}
        if not available:
            detail[role]["reason"] = state.pools.unavailable_reason(role)
    # Ready when some shape can serve: a prefill and a decode, or an aggregated worker.
    ready = (can[PREFILL] and can[DECODE]) or can[AGGREGATED]
    detail["index"] = state.index_detail()
    detail["status"] = "ready" if ready else "not ready"
    return json_response(detail, status=200 if ready else 503)


async def list_workers(svc: Services, request: Request) -> Response:
    """The workers per role; static/admin workers an etcd record of their URL stands for are
    listed apart under ``shadowed`` (one server, listed once per role)."""
    state = svc.state
    answer: dict[str, list[dict[str, Any]]] = {
        role: [w.describe() for w in state.pools.pool(role) if w.counted] for role in ROLES}
    answer["shadowed"] = [w.describe() for w in state.pools.all() if not w.counted]
    return json_response(answer)


def _check_admin(svc: Services, request: Request) -> Response | None:
    token = svc.state.config.admin_token
    if token is None:
        return json_error(403, "worker administration is disabled: start the router with "
                               "--admin-token")
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        return json_error(401, "missing or wrong admin token (Authorization: Bearer TOKEN)")
    return None


def _admin_args(request: Request) -> dict[str, Any]:
    args: dict[str, Any] = dict(request.query)
    if request.body:
        args.update(load_json(request.body))
    return args


async def add_worker(svc: Services, request: Request) -> Response:
    """``POST /workers`` (admin token): add a worker, or update an admin/static one, from
    ``url``, ``role`` (or ``worker_type``), ``instance_id`` and ``bootstrap_port`` (query or
    JSON body); 201 with the worker. A 409 when the id or URL is an etcd-discovered worker's.

    Workers an etcd instance record describes belong to discovery: while the record lives, the
    worker is in its pool and its URL is the record's. The admin API refuses (409, naming the
    record) to remove such a worker, to add one with its instance id or its URL (any role), or
    to move one; to take it out of service drain its engine or stop its sidecar, and its record
    goes with its lease. Static and admin workers are the admin API's to add and remove."""
    denied = _check_admin(svc, request)
    if denied is not None:
        return denied
    state = svc.state
    try:
        args = _admin_args(request)
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
                                 model=state.config.model, source=ADMIN)
    except ValueError as exc:  # a bad URL or port, as the pools and the config say it
        raise BadRequest("", str(exc)) from None
    return json_response(worker.describe(), status=201)


async def delete_worker(svc: Services, request: Request) -> Response:
    """``DELETE /workers`` (admin token): remove the worker of ``instance_id``, or every worker
    of ``url``; 404 when there is none. A 409 when it is an etcd-discovered worker's.

    Workers an etcd instance record describes belong to discovery: while the record lives, the
    worker is in its pool and its URL is the record's. The admin API refuses (409, naming the
    record) to remove such a worker, to add one with its instance id or its URL (any role), or
    to move one; to take it out of service drain its engine or stop its sidecar, and its record
    goes with its lease. Static and admin workers are the admin API's to add and remove."""
    denied = _check_admin(svc, request)
    if denied is not None:
        return denied
    state = svc.state
    args = _admin_args(request)
    url, iid = args.get("url"), args.get("instance_id")
    if isinstance(iid, str):
        state.pools.refuse_discovered(f"worker {iid} is not removed", instance_id=iid)
        gone = [w for w in (state.pools.remove(r, iid) for r in ROLES) if w]
    elif isinstance(url, str):
        state.pools.refuse_discovered(f"the workers at {url} are not removed", url=url)
        gone = state.pools.remove_url(url)
    else:
        return json_error(400, "give url or instance_id (query or JSON body)")
    if not gone:
        return json_error(404, f"no worker with {'instance_id' if iid else 'url'} "
                               f"{iid or url!r}")
    return json_response({"removed": [w.describe() for w in gone]})


async def metrics(svc: Services, request: Request) -> Response:
    state = svc.state
    state.refresh_gauges()
    return Response(200, state.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")


async def get_thresholds(svc: Services, request: Request) -> Response:
    return json_response(svc.state.thresholds.describe())


async def put_thresholds(svc: Services, request: Request) -> Response:
    """Change the thresholds at run time: a JSON object with ``busy_queue``,
    ``busy_kv_usage`` (null turns one off) and/or ``disagg_tokens``; keys left out stay as
    they are."""
    denied = _check_admin(svc, request)
    if denied is not None:
        return denied
    doc = load_json(request.body) if request.body else None
    if not isinstance(doc, dict) or not doc:
        raise BadRequest("", "send a JSON object with busy_queue, busy_kv_usage and/or "
                             "disagg_tokens")
    unknown = sorted(set(doc) - {"busy_queue", "busy_kv_usage", "disagg_tokens"})
    if unknown:
        raise BadRequest(unknown[0], "is not a threshold; use busy_queue, busy_kv_usage or "
                                     "disagg_tokens")
    th = svc.state.thresholds
    queue = doc.get("busy_queue", th.busy_queue)
    usage = doc.get("busy_kv_usage", th.busy_kv_usage)
    # One value at a time, so that the field at fault is known without reading the message.
    for field, one in (("busy_queue", (queue, None)), ("busy_kv_usage", (None, usage))):
        try:
            check_thresholds(*one)
        except ValueError as exc:  # its message names the field and says what it takes
            raise BadRequest("", str(exc), param=field) from None
    disagg = doc.get("disagg_tokens", th.disagg_tokens)
    try:
        check_disagg_tokens(disagg)
    except ValueError as exc:
        raise BadRequest("", str(exc), param="disagg_tokens") from None
    th.busy_queue, th.busy_kv_usage, th.disagg_tokens = queue, usage, disagg
    logger.info("thresholds now %s", th.describe())
    return json_response(th.describe())
