"""Dual dispatch with retries: the same body to a prefill and a decode at once, the decode's
answer to the client (streamed through unbuffered when it streams).

One attempt fails as a whole, and is retried with a new pair and a new room, when the prefill
fails (transport error or 5xx: 502, counted against the prefill's breaker only), or when the
decode fails by transport or answers 408/429/500/502/503/504. Nothing is retried once the first
byte of a stream went to the client.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from router.policy import RouteContext
from router.requests import Parsed, inject
from router.state import NoWorkers, Pair, RouterState
from router.workers import Worker

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
HOP_HEADERS = ("authorization", "x-request-id", "traceparent", "tracestate")


@dataclass
class Failure:
    """A failed attempt: what the client gets if no later attempt succeeds."""

    status: int
    body: bytes
    content_type: str
    failed: str
    """Instance id to avoid on the next attempt."""


def json_error(status: int, message: str, request_id: str | None = None,
               **extra: Any) -> web.Response:
    headers = {"x-request-id": request_id} if request_id else None
    return web.json_response({"error": message, **extra}, status=status, headers=headers)


def _record(state: RouterState, worker: Worker, status: int | None, reason: str = "") -> None:
    # 4xx is the client's fault, not the worker's: it counts as a success.
    if status is None or status >= 500:
        worker.breaker.record_failure()
        m = state.metrics
        m.child(m.upstream_errors, worker.role, reason or str(status)).inc()
    else:
        worker.breaker.record_success()


class Dispatcher:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.background: set[asyncio.Task[Any]] = set()

    def _timeout(self) -> aiohttp.ClientTimeout:
        cfg = self.state.config
        return aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout,
                                     sock_read=cfg.request_timeout)

    async def forward(self, request: web.Request, route: str, path: str, parsed: Parsed,
                      headers: dict[str, str], request_id: str) -> web.StreamResponse:
        state, cfg = self.state, self.state.config
        ctx = RouteContext(parsed.prompts[0], parsed.model or cfg.model)
        failed: set[str] = set()
        last: Failure | None = None
        for attempt in range(cfg.retry_max_attempts):
            if attempt:
                state.metrics.child(state.metrics.retries, route).inc()
                delay = cfg.backoff(attempt - 1)
                await asyncio.sleep(delay * (1 + state.rng.uniform(-cfg.retry_jitter,
                                                                   cfg.retry_jitter)))
            try:
                pair = state.select_pair(ctx, failed)
            except NoWorkers as exc:
                if last is None:
                    return json_error(503, str(exc), request_id, role=exc.role)
                break
            p = pair.prefill.worker
            body, rooms = inject(parsed, p.bootstrap_host, p.bootstrap_port, state.rng)
            state.on_routed(pair)
            result = await self._attempt(request, path, pair, body, headers, parsed.stream,
                                         request_id)
            if not isinstance(result, Failure):
                return result
            last = result
            failed.add(result.failed)
            logger.info("attempt %d of %s (room %d) failed with %d on %s", attempt + 1,
                        request_id, rooms[0], result.status, result.failed)
        assert last is not None
        return web.Response(status=last.status, body=last.body,
                            headers={"content-type": last.content_type,
                                     "x-request-id": request_id})

    async def _attempt(self, request: web.Request, path: str, pair: Pair, body: bytes,
                       headers: dict[str, str], stream: bool,
                       request_id: str) -> web.StreamResponse | Failure:
        prefill, decode = pair.prefill.worker, pair.decode.worker
        prefill.requests += 1
        decode.requests += 1
        # Counted now, not when the task first runs, so that the very next decision sees it;
        # released by a callback, which also runs when the task is cancelled before starting.
        prefill.load += 1
        prefill_task = asyncio.create_task(self._prefill(prefill, path, body, headers))
        prefill_task.add_done_callback(lambda _: _release(prefill))
        decode.load += 1
        decode_t0 = time.perf_counter()
        decode_task = asyncio.create_task(self._decode(decode, path, body, headers, stream))
        try:
            pending: set[asyncio.Task[Any]] = {prefill_task, decode_task}
            while not decode_task.done():
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_task.done() and prefill_task.result() is not None:
                    # No KV will come: stop the decode rather than let it wait for a timeout.
                    await _cancel(decode_task)
                    decode.load -= 1
                    return self._prefill_failure(prefill, prefill_task.result())
        except asyncio.CancelledError:
            await _cancel(decode_task)
            await _cancel(prefill_task)
            decode.load -= 1
            raise
        try:
            resp, first = decode_task.result()
        except Exception as exc:  # noqa: BLE001 - any decode failure is this attempt's failure
            decode.load -= 1
            _record(self.state, decode, None, "transport")
            await _cancel(prefill_task)
            return Failure(502, _err(f"decode {decode.instance_id} failed: {exc!r}"),
                           "application/json", decode.instance_id)
        status = resp.status
        if status in RETRY_STATUSES or status >= 500:
            decode.load -= 1
            _record(self.state, decode, status)
            await _cancel(prefill_task)
            resp.release()
            return Failure(status, first, resp.content_type or "application/json",
                           decode.instance_id)
        if not stream or status != 200:
            _record(self.state, decode, status)
            decode.load -= 1
            self.state.metrics.latency["decode"].observe(
                time.perf_counter() - decode_t0)
            if not stream:
                # Non-streamed: the prefill's outcome decides too (SGLang waits for both).
                await asyncio.wait({prefill_task})
                err = prefill_task.result()
                if err is not None:
                    return self._prefill_failure(prefill, err)
            else:
                self._keep(prefill_task)
            resp.release()
            return web.Response(status=status, body=first,
                                headers={"content-type": resp.headers.get(
                                    "content-type", "application/json"),
                                    "x-request-id": request_id})
        if prefill_task.done() and prefill_task.result() is not None:
            # The decode started streaming but its KV source failed: nothing sent yet, retry.
            decode.load -= 1
            resp.close()
            return self._prefill_failure(prefill, prefill_task.result())
        self._keep(prefill_task)
        return await self._stream(request, decode, resp, first, request_id, decode_t0)

    def _prefill_failure(self, prefill: Worker, err: tuple[int | None, str]) -> Failure:
        status, reason = err
        return Failure(502, _err(f"prefill {prefill.instance_id} failed: {reason}"),
                       "application/json", prefill.instance_id)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _prefill(self, worker: Worker, path: str, body: bytes,
                       headers: dict[str, str]) -> tuple[int | None, str] | None:
        """None on success, else (status or None, reason)."""
        t0 = time.perf_counter()
        try:
            assert self.state.session is not None
            async with self.state.session.post(worker.url + path, data=body, headers=headers,
                                               timeout=self._timeout()) as resp:
                # The answer is drained so the connection can be reused; SGLang ignores it.
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            _record(self.state, worker, None, "transport")
            return None, f"transport error {exc!r}"
        except Exception as exc:  # noqa: BLE001 - never let one upstream take the router down
            logger.exception("prefill %s: unexpected error", worker.instance_id)
            _record(self.state, worker, None, "error")
            return None, f"unexpected error {exc!r}"
        finally:
            self.state.metrics.latency["prefill"].observe(
                time.perf_counter() - t0)
        _record(self.state, worker, status)
        if status >= 500:
            return status, f"status {status}"
        return None

    async def _decode(self, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                      stream: bool) -> tuple[aiohttp.ClientResponse, bytes]:
        """The decode's response with its whole body, or (stream) its first chunk."""
        assert self.state.session is not None
        resp = await self.state.session.post(worker.url + path, data=body, headers=headers,
                                             timeout=self._timeout())
        try:
            if stream and resp.status == 200:
                first = await resp.content.readany()
            else:
                first = await resp.read()
        except BaseException:
            resp.close()
            raise
        return resp, first

    async def _stream(self, request: web.Request, decode: Worker, upstream: aiohttp.ClientResponse,
                      first: bytes, request_id: str, t0: float) -> web.StreamResponse:
        out = web.StreamResponse(status=upstream.status, headers={
            "content-type": upstream.headers.get("content-type", "text/event-stream"),
            "cache-control": "no-cache", "x-request-id": request_id})
        ok = False
        try:
            await out.prepare(request)
            if first:
                await out.write(first)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            ok = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("stream from decode %s broke after the first byte (not retried): %r",
                           decode.instance_id, exc)
        except (ConnectionResetError, OSError):
            logger.info("client of %s went away mid-stream", request_id)
            ok = True
        finally:
            decode.load -= 1
            if ok:
                upstream.release()
            else:
                upstream.close()
            _record(self.state, decode, 200 if ok else None, "stream")
            self.state.metrics.latency["decode"].observe(time.perf_counter() - t0)
        return out

    async def close(self) -> None:
        for task in list(self.background):
            await _cancel(task)


def _release(worker: Worker) -> None:
    worker.load -= 1


async def _cancel(task: asyncio.Task[Any]) -> None:
    if task.done():
        if not task.cancelled():
            exc = task.exception()
            if exc is None:
                res = task.result()
                if isinstance(res, tuple) and res and isinstance(res[0], aiohttp.ClientResponse):
                    res[0].close()
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass


def _err(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
