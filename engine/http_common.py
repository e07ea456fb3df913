"""Pieces shared by the engine's HTTP handlers: app state, errors as JSON, SSE, running one
request to completion."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from bootstrap.http_errors import ErrorAnswer, Refusal, json_error, shaped
from bootstrap.http_limits import body_deadline
from engine.config import ModelConfig
from engine.errors import BadRequest, CapacityError, DuplicateRequest, EngineError
from engine.protocol import GenInput, load_json
from engine.runner import AsyncEngine
from engine.scheduler import RequestOutput
from engine.serve_config import EngineServerConfig
from tokenization.base import Tokenizer

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
"""How often a non-streaming handler checks that its client is still connected."""


@dataclass
class EngineState:
    """What every handler of one worker reads (the app's ``STATE_KEY``)."""

    config: EngineServerConfig
    model: ModelConfig
    tokenizer: Tokenizer
    """The engine's tokenizer: every prompt is encoded and every output decoded by it."""
    engine: AsyncEngine
    registry: CollectorRegistry
    model_path: str
    """What ``model_path`` reports: the checkpoint, or the seeded model's written directory."""
    started: float


CONFIG_KEY = web.AppKey("engine_config", EngineServerConfig)
STATE_KEY = web.AppKey("engine_state", EngineState)


def state(request: web.Request) -> EngineState:
    return request.app[STATE_KEY]


STATUS_OF: dict[type[EngineError], int] = {BadRequest: 400, DuplicateRequest: 409,
                                           CapacityError: 503}
"""The HTTP status of each engine error a client can cause (the one mapping, also used for
the items of a PD batch)."""


def error_status(exc: BaseException) -> int | None:
    """The status ``exc`` maps to, or None for an error that is not the client's."""
    return next((code for cls, code in STATUS_OF.items() if isinstance(exc, cls)), None)


def error_answer(exc: EngineError, status: int, **extra: Any) -> ErrorAnswer:
    """The answer to an engine error a client caused (``status`` from ``error_status``):
    its message, and the field at fault (OpenAI's ``param``) for a ``BadRequest``."""
    param = exc.field if isinstance(exc, BadRequest) else None
    return json_error(status, str(exc), param=param, **extra)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
    """The engine's one error boundary: engine errors become their status, aiohttp's own
    (no route, wrong method) JSON, and every error answer takes its route's shape (SGLang's
    ``{"error": message}``, or OpenAI's error object on ``/v1/`` routes)."""
    try:
        return shaped(request, await handler(request))
    except web.HTTPException as exc:
        if exc.status >= 400 and not isinstance(exc, Refusal):
            return shaped(request, json_error(exc.status, exc.reason))
        raise shaped(request, exc) from None
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:  # the process never dies for one request
        if isinstance(exc, EngineError) and (code := error_status(exc)) is not None:
            return shaped(request, error_answer(exc, code))
        logger.exception("%s %s failed", request.method, request.path)
        return shaped(request, json_error(500, f"internal error: {type(exc).__name__}: {exc}"))


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        async with body_deadline(request):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        raise Refusal(413, f"request body is larger than {limit} bytes (the server's "
                           f"--max-request-bytes)") from None
    return load_json(raw)


async def until_disconnected(request: web.Request, aw: Awaitable[Any]) -> Any:
    """Await ``aw`` unless the client goes away first: then cancel it (which aborts the engine
    requests it runs) and raise CancelledError, as aiohttp's ``handler_cancellation`` would.

    aiohttp cancels a handler on disconnect only when its runner was made with
    ``handler_cancellation=True`` (off by default, e.g. in ``web.run_app``), and a non-streaming
    handler writes nothing until the end, so without this a client that hangs up would keep
    its request decoding to ``max_new_tokens``.
    """
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                # A cancellation, not an error: aiohttp takes it for the premature disconnect
                # it is (logged at debug); any other exception is logged with its traceback
                # and a 500 written to the closed socket, once per hung-up request.
                raise asyncio.CancelledError(f"client of {request.path} disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- generation helpers ------------------------------------------------------------------------
async def collect(st: EngineState, gi: GenInput) -> tuple[list[int], str, RequestOutput]:
    """Run one request to the end; returns (output ids, text, last output)."""
    return await collect_outputs(st.engine.generate(gi.prompt, gi.params, gi.rid))


async def collect_outputs(outputs: AsyncIterator[RequestOutput]
                          ) -> tuple[list[int], str, RequestOutput]:
    """Consume a request's outputs to the end; returns (output ids, text, last output)."""
    ids: list[int] = []
    text: list[str] = []
    last: RequestOutput | None = None
    async with contextlib.aclosing(outputs) as gen:
        async for out in gen:
            ids.extend(out.new_ids)
            text.append(out.text_delta)
            last = out
    assert last is not None
    if last.error:
        raise RuntimeError(last.error)
    return ids, "".join(text), last


def check_fits(st: EngineState, gi: GenInput) -> None:
    st.engine.scheduler.check_fits(len(gi.prompt), gi.params.max_new_tokens)


@contextlib.contextmanager
def hang_up_cancels() -> Iterator[None]:
    """A write to a client that hung up ends the handler as a cancellation (as
    ``until_disconnected`` does): raised as the ConnectionResetError it is, aiohttp would log
    it with a traceback, once per stream a client stops."""
    try:
        yield
    except ConnectionResetError as exc:
        raise asyncio.CancelledError(f"client went away mid-stream: {exc}") from exc


async def sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    with hang_up_cancels():
        await resp.prepare(request)
    return resp


async def sse_send(resp: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    with hang_up_cancels():
        await resp.write(f"data: {data}\n\n".encode())


async def sse_end(resp: web.StreamResponse) -> None:
    """The stream's last event (``[DONE]``) and its end."""
    await sse_send(resp, "[DONE]")
    with hang_up_cancels():
        await resp.write_eof()
