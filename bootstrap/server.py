"""The bootstrap HTTP server: an aiohttp app factory, wire-compatible with SGLang's
``CommonKVBootstrapServer`` (see reference/sglang-bootstrap.md), with stricter input checks.

SGLang's own answers (plain-text ``OK``, its 400/503/404 texts, the topology document) are kept
byte for byte so that SGLang's clients work unchanged. Where SGLang would answer 500 (bad JSON,
missing field, non-integer parameter) this server answers 400 with ``{"error": ...}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bootstrap.config import BootstrapConfig
from bootstrap.dp_rooms import DpRoomMap
from bootstrap.errors import BadRequest, RequestError
from bootstrap.http_errors import json_error
from bootstrap.http_limits import NOT_UTF8, body_deadline, bound_reads, utf8_text
from bootstrap.metrics import BootstrapMetrics
from bootstrap.mirror import RankMirror
from bootstrap.table import RankTable, RegistrationError, parse_registration
from index.rooms import ROOMS

logger = logging.getLogger(__name__)

ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
MISSING_INPUTS = "Missing inputs for bootstrap server."
_INT_RE = re.compile(r"\s*[-+]?\d{1,19}\s*")


@dataclass
class BootstrapState:
    config: BootstrapConfig
    table: RankTable
    rooms: DpRoomMap
    metrics: BootstrapMetrics
    mirror: RankMirror | None

    @property
    def mirror_state(self) -> str:
        return "disabled" if self.mirror is None else self.mirror.state


STATE = web.AppKey("bootstrap_state", BootstrapState)


def _refuse_constant(name: str) -> Any:
    # NaN never equals itself, so a NaN topology field would 409 every later rank forever.
    raise BadRequest(f"request body contains {name}, which is not valid JSON")


async def read_json(request: web.Request, limit: int) -> Any:
    """The request body as JSON, refusing bodies over ``limit`` bytes without reading them all."""
    too_big = f"request body exceeds the {limit} byte limit"
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(too_big, 413)
    chunks: list[bytes] = []
    size = 0
    async with body_deadline(request):
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise BadRequest(too_big, 413)
            chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    text = utf8_text(raw)  # json.loads would take bytes in UTF-16/32, which the engines refuse
    if text is None:
        raise BadRequest(f"request body {NOT_UTF8}")
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except BadRequest:
        raise
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def _lenient_int(value: Any, name: str) -> int:
    """An int, or a decimal string of one (SGLang applies ``int()``); never a bool or float."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INT_RE.fullmatch(value):
        return int(value)
    raise BadRequest(f"'{name}' must be an integer, got {json.dumps(value)[:64]}")


def _room(value: Any, name: str) -> int:
    room = _lenient_int(value, name)
    if room not in ROOMS:  # the range SGLang accepts (index.rooms), not all a u64 can hold
        raise BadRequest(f"'{name}' must be in {ROOMS}, got {room}")
    return room


# --- middleware ------------------------------------------------------------------------------


@web.middleware
async def _guard(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                 ) -> web.StreamResponse:
    state = request.app[STATE]
    token = state.config.auth_token
    if token is not None and request.method in ("PUT", "POST"):
        given = request.headers.get("Authorization", "")
        # aiohttp decodes header bytes with surrogateescape; keep them comparable, never raise.
        given_raw = given.encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given_raw, f"Bearer {token}".encode()):
            state.metrics.unauthorized.inc()
            resp = json_error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                               "with the server's --auth-token")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
    try:
        return await handler(request)
    except RequestError as exc:  # the one place the server's refusals become answers
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise  # a redirect, or an answer that already says why (a 408 of body_deadline)
        return json_error(exc.status, f"{exc.reason}: {request.method} {request.path}")
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(500, "internal error; see the bootstrap server's log")


# --- handlers --------------------------------------------------------------------------------


async def route_put(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await read_json(request, state.config.max_body_bytes)
    except BadRequest:
        state.metrics.registrations.labels("invalid").inc()
        raise
    try:
        reg = parse_registration(body)
        outcome = state.table.register(reg)
    except RegistrationError as exc:
        state.metrics.registrations.labels("conflict" if exc.status == 409 else "invalid").inc()
        raise
    state.metrics.registrations.labels(outcome).inc()
    if state.mirror is not None and outcome != "unchanged":
        state.mirror.publish_cell(reg.cell)
    table = state.table
    logger.debug("registered rank dp=%d cp=%d tp=%d pp=%d at %s:%d (%d/%s)", *reg.cell,
                 reg.rank_ip, reg.rank_port, table.registered, table.expected)
    if outcome == "new" and table.ready and table.registered == table.expected:
        logger.info("all %d ranks registered; instance %s is ready", table.registered,
                    state.config.instance_id)
    return web.Response(text="OK")


async def route_get(request: web.Request) -> web.Response:
    state = request.app[STATE]
    kind, resp = _route_answer(state, request)
    state.metrics.route_query(kind, resp.status)
    return resp


def _route_answer(state: BootstrapState, request: web.Request) -> tuple[str, web.Response]:
    """(query kind, answer) of one ``GET /route``."""
    raw = [request.query.get(name) for name in ROUTE_PARAMS]
    if not all(raw):  # SGLang: a missing or empty parameter
        return "rank", web.Response(text=MISSING_INPUTS, status=400)
    values: list[int] = []
    for name, text in zip(ROUTE_PARAMS, raw):
        if not _INT_RE.fullmatch(text):  # type: ignore[arg-type]
            return "rank", json_error(400, f"query parameter '{name}' must be an integer, got {text!r}")
        values.append(int(text))  # type: ignore[arg-type]
    dp, cp, tp, pp = values
    kind = "topology" if dp == cp == tp == pp == -1 else "rank"
    table = state.table
    if not table.ready:
        return kind, web.Response(
            text=f"Prefill server not fully registered yet ({table.registered} workers "
                 f"registered).", status=503)
    if kind == "topology":
        assert table.topology is not None
        return kind, web.json_response(table.topology.document())
    entry = table.lookup((dp, cp, tp, pp))
    if entry is None:
        return kind, web.Response(
            text=f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} "
                 f"pp_rank={pp}", status=404)
    return kind, web.json_response(entry.address())


async def register_dp_rank(request: web.Request) -> web.Response:
    state = request.app[STATE]
    status = "400"
    try:
        body = await read_json(request, state.config.max_body_bytes)
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object with 'bootstrap_room' and 'dp_rank'")
        for name in ("bootstrap_room", "dp_rank"):
            if name not in body:
                raise BadRequest(f"missing field '{name}'")
        room = _room(body["bootstrap_room"], "bootstrap_room")
        dp_rank = _lenient_int(body["dp_rank"], "dp_rank")
        topo = state.table.topology
        if dp_rank < 0 or (topo is not None and dp_rank >= topo.dp_size):
            bound = f"0..{topo.dp_size - 1}" if topo is not None else "a non-negative integer"
            raise BadRequest(f"'dp_rank' must be {bound}, got {dp_rank}")
        state.rooms.register(room, dp_rank)
        status = "200"
        return web.Response(text="OK")
    finally:
        state.metrics.dp_requests.labels("register_dp_rank", status).inc()


async def query_dp_ranks(request: web.Request) -> web.Response:
    state = request.app[STATE]
    status = "400"
    try:
        body = await read_json(request, state.config.max_body_bytes)
        if not isinstance(body, dict) or "bootstrap_rooms" not in body:
            raise BadRequest("body must be a JSON object with a 'bootstrap_rooms' list")
        rooms_in = body["bootstrap_rooms"]
        if not isinstance(rooms_in, list):
            raise BadRequest("'bootstrap_rooms' must be a list of integers")
        rooms = [_room(r, "bootstrap_rooms[]") for r in rooms_in]
        result = state.rooms.query(rooms)
        status = "200"
        return web.json_response(result)
    finally:
        state.metrics.dp_requests.labels("query_dp_ranks", status).inc()


async def health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def ready(request: web.Request) -> web.Response:
    table = request.app[STATE].table
    expected = table.expected
    if expected is None:
        text = "0 ranks registered (the expected count is known once the first rank registers)"
    else:
        text = f"{table.registered} of {expected} ranks registered"
    return web.Response(text=text, status=200 if table.ready else 503)


async def table_get(request: web.Request) -> web.Response:
    state = request.app[STATE]
    cfg = state.config
    doc = {"instance_id": cfg.instance_id, "model": cfg.model, **state.table.snapshot(),
           "mirror": {"state": state.mirror_state,
                      "lag_seconds": 0.0 if state.mirror is None else state.mirror.lag}}
    return web.json_response(doc)


async def metrics_get(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = content_type
    return resp


# --- the app ---------------------------------------------------------------------------------


async def _mirror_ctx(app: web.Application) -> AsyncIterator[None]:
    mirror = app[STATE].mirror
    if mirror is not None:
        await mirror.start()
    yield
    if mirror is not None:
        await mirror.close(revoke=True)


async def _sweeper_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(state.config.dp_room_sweep_interval)
            dropped = state.rooms.sweep()
            if dropped:
                logger.debug("dropped %d expired room entries", dropped)

    task = asyncio.create_task(sweep_forever(), name="bootstrap-dp-room-sweep")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(config: BootstrapConfig) -> web.Application:
    """The bootstrap server for one prefill instance. Run it with ``http_limits.make_runner``
    (a plain ``web.AppRunner`` would let a slow client hold a connection for an hour)."""
    table = RankTable()
    state = BootstrapState(
        config=config, table=table,
        rooms=DpRoomMap(config.dp_room_ttl, config.dp_room_max_entries),
        metrics=BootstrapMetrics(),
        mirror=RankMirror(config, table) if config.etcd is not None else None,
    )
    state.metrics.bind(
        registered=lambda: table.registered,
        expected=lambda: table.expected or 0,
        ready=lambda: 1.0 if table.ready else 0.0,
        mirror_state=lambda: state.mirror_state,
        mirror_lag=lambda: 0.0 if state.mirror is None else state.mirror.lag,
        mirror_pending=lambda: 0.0 if state.mirror is None else state.mirror.keys.pending,
        dp_rooms=lambda: len(state.rooms),
        dp_rooms_evicted=lambda: state.rooms.evicted,
    )
    # Bodies are read by read_json with our own limit; this only bounds aiohttp's own readers.
    app = web.Application(middlewares=[_guard],
                          client_max_size=config.max_body_bytes + 1)
    app[STATE] = state
    bound_reads(app, config.read_timeout_s)  # serve it with http_limits.make_runner
    app.router.add_put("/route", route_put)
    app.router.add_get("/route", route_get)
    app.router.add_post("/register_dp_rank", register_dp_rank)
    app.router.add_post("/query_dp_ranks", query_dp_ranks)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/table", table_get)
    app.router.add_get("/metrics", metrics_get)
    app.cleanup_ctx.append(_mirror_ctx)
    app.cleanup_ctx.append(_sweeper_ctx)
    return app
