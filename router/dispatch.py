"""Dual dispatch with retries: the same body to a prefill and a decode at once, the decode's
answer to the client (streamed through unbuffered when it streams).

One attempt fails as a whole, and is retried with a new pair and a new room, when the prefill
fails (transport error or 5xx: 502, counted against the prefill's breaker only), or when the
decode fails by transport or answers 408/429/500/502/503/504. Nothing is retried once the first
byte of a stream went to the client.

A client that goes away (its connection closes, and the server cancels the handler) is not a
worker failure: both upstream requests are dropped, which is how an engine learns to abort, the
hang-up is counted as ``client_disconnects`` and no breaker hears of it. Users pressing "stop"
must not open a decode's circuit.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass

from index.pd_protocol import PULL, PUSH, VLLM
from router.capacity import request_need
from router.client_ids import ClientRid, RidEcho, engine_rid
from router.errors import NoWorkers, error_response, json_error
from router.explain import EXPLAIN_HEADER, last_cached_tokens, reported_cached_tokens, wanted
from router.http.client import UpstreamError, UpstreamResponse
from router.http.headers import encode_headers
from router.http.server import Request, Response, Stream
from router.requests import Parsed, inject, with_rid
from router.route import decide, route_context
from router.state import Pair, RouterState
from router.upstreams import Upstreams
from router.vllm_pd import (
    answered_params,
    decode_body,
    engine_request_id,
    new_request_id,
    prefill_body,
)
from router.workers import DECODE, Worker

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
    message: str | None = None
    """The router's own reason (an upstream it could not reach): answered as an error of the
    route's shape. None: ``body`` is the worker's own answer, relayed as it is."""

    @classmethod
    def of_router(cls, status: int, message: str, failed: str) -> Failure:
        return cls(status, b"", "application/json", failed, message)

    def answer(self, request_id: str) -> Response:
        if self.message is not None:
            return json_error(self.status, self.message, request_id)
        return Response(self.status, self.body, self.content_type, {"x-request-id": request_id})


class _Counted:
    """One request in ``worker.load``, taken off once by whichever of its ends comes first."""

    __slots__ = ("worker", "_counted")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        worker.load += 1
        self._counted = True

    def end(self) -> None:
        if self._counted:
            self._counted = False
            self.worker.load -= 1


def _record(state: RouterState, worker: Worker, status: int | None, reason: str = "") -> None:
    # 4xx is the client's fault, not the worker's: it counts as a success.
    if status is None or status >= 500:
        worker.breaker.record_failure()
        m = state.metrics
        m.child(m.upstream_errors, worker.role, reason or str(status)).inc()
    else:
        worker.breaker.record_success()


class Dispatcher:
    def __init__(self, state: RouterState, upstreams: Upstreams) -> None:
        self.state = state
        self.upstreams = upstreams

    async def forward(self, request: Request, route: str, path: str, parsed: Parsed,
                      headers: dict[str, str], request_id: str,
                      client_rid: ClientRid | None = None) -> Response | Stream:
        try:
            return await self._forward(request, route, path, parsed, headers, request_id,
                                       client_rid)
        except asyncio.CancelledError:
            # The server cancels a handler only when its client's connection closed; whatever
            # phase it was in dropped its upstream calls on the way out.
            m = self.state.metrics
            m.child(m.client_disconnects, route).inc()
            logger.info("client of %s went away before the answer was complete", request_id)
            raise

    async def _forward(self, request: Request, route: str, path: str, parsed: Parsed,
                       headers: dict[str, str], request_id: str,
                       client_rid: ClientRid | None) -> Response | Stream:
        state, cfg = self.state, self.state.config
        ctx = route_context(parsed)  # kept across retries: hashed once
        wire_headers = encode_headers(headers)
        explaining = wanted(request.headers, cfg)
        cap = state.capacity
        need = request_need(parsed.body, parsed.prompts) if cap.enabled else None
        # Not routed to a worker whose own limits it exceeds (router/limits.py).
        unfit = state.pools.limits.unfit(parsed.prompts, len(request.body))
        failed: set[str] = set()
        last: Failure | None = None
        rid: ClientRid | None = None
        echo: RidEcho | None = None
        for attempt in range(cfg.retry_max_attempts):
            if attempt:
                state.metrics.child(state.metrics.retries, route).inc()
                delay = cfg.backoff(attempt - 1)
                await asyncio.sleep(delay * (1 + state.rng.uniform(-cfg.retry_jitter,
                                                                   cfg.retry_jitter)))
            try:
                # Among the workers with room, waiting for one if need be (router/capacity.py).
                decision = await cap.admit(functools.partial(decide, state, ctx, failed, need,
                                                             unfit=unfit))
            except NoWorkers as exc:
                if last is None:
                    return error_response(exc, request_id)
                break
            pair = decision.pair
            p = pair.prefill.worker
            decode = pair.decode.worker if pair.decode is not None else None
            if client_rid is not None:
                rid = engine_rid(client_rid)
                echo = RidEcho(rid, client_rid)
            vllm = decode is not None and p.protocol.name == VLLM
            if decode is None:  # aggregated: the body as received (the engine's own rid)
                body, rooms = with_rid(parsed, rid), None
            elif vllm:  # each side's own body, made per attempt (router/vllm_pd.py)
                body, rooms = b"", None
            else:
                body, rooms = inject(parsed, p.bootstrap_host, p.bootstrap_port, rid)
            state.on_routed(pair)
            reply = {"x-request-id": request_id}
            if explaining:
                reply[EXPLAIN_HEADER] = decision.explain(state)
            # The worker that answers the client holds the prompt and what it generates.
            answering = decode or p
            held = (cap.take(p, need, False) if decode is not None else 0,
                    cap.take(answering, need, True)) if need is not None else (0, 0)
            try:
                if decode is None:
                    result = await self._attempt_one(
                        request, path, p, body,
                        local_headers(headers) if p.role == DECODE else wire_headers,
                        parsed.stream, reply, echo)
                elif vllm:
                    result = await self._attempt_vllm(request, path, pair, parsed, headers,
                                                      reply, echo, held[0])
                else:
                    result = await self._attempt(request, path, pair, (body, body),
                                                 wire_headers, parsed.stream, reply, echo,
                                                 held[0])
            finally:
                # The answering call ended with the attempt (a stream: once it was relayed).
                cap.give(answering, held[1], finished=True)
            if not isinstance(result, Failure):
                if not isinstance(result, Response) or result.status < 400:
                    # Served (a stream only starts on the decode's 200): the prefill computed
                    # this prompt's KV, so its index entries should show it soon (canaries).
                    state.on_served(pair, ctx)
                return result
            last = result
            failed.add(result.failed)
            logger.info("attempt %d of %s (room %s, rid %s for the client's %s) failed with %d "
                        "on %s", attempt + 1, request_id, rooms[0] if rooms else None, rid,
                        client_rid, result.status, result.failed)
        assert last is not None
        return last.answer(request_id)

    async def _attempt(self, request: Request, path: str, pair: Pair,
                       bodies: tuple[bytes, bytes], headers: bytes, stream: bool,
                       reply: dict[str, str], echo: RidEcho | None, prefill_pages: int = 0
                       ) -> Response | Stream | Failure:
        """One attempt at a pair whose halves are sent at once (SGLang's bootstrap, vLLM's
        push): ``bodies`` are the prefill's and the decode's; ``reply``: the headers of the
        client's answer (its request id, and the route's explanation when asked for);
        ``prefill_pages``: what the prefill's call holds (``Capacity.take``), given back when
        it ends."""
        prefill, decode = pair.prefill.worker, pair.decode.worker
        prefill.requests += 1
        decode.requests += 1
        # Counted now so that the very next decision sees it. The prefill's ends at the
        # decode's first byte (its KV has arrived, so its compute is done) or with its own
        # call, whichever is first: that call may stay open until the send is acknowledged,
        # past the end of a short stream, and a conversation's next turn must not then see
        # the prefix's holder as still busy with the last one.
        prefill_load = _Counted(prefill)
        decode.load += 1
        t0 = time.perf_counter()
        prefill_call = self.upstreams.of(prefill).call("POST", path, headers, bodies[0])
        decode_call = self.upstreams.of(decode).call("POST", path, headers, bodies[1],
                                                     stream=stream)
        prefill_call.add_done_callback(
            functools.partial(self._prefill_done, prefill_load, t0, decode_call, prefill_pages))
        try:
            resp = await decode_call
            first = await _first_bytes(resp, stream)
            if resp.status == 200:
                prefill_load.end()
        except asyncio.CancelledError:
            err = _prefill_error(prefill_call)
            task = asyncio.current_task()
            if err is None or (task is not None and task.cancelling()):
                _drop(decode_call)
                _drop(prefill_call)
                decode.load -= 1
                raise
            # The prefill failed first and its callback stopped the decode: no KV would come.
            decode.load -= 1
            return self._prefill_failure(prefill, err)
        except UpstreamError as exc:
            decode.load -= 1
            _record(self.state, decode, None, "transport")
            _drop(decode_call)
            _drop(prefill_call)
            return Failure.of_router(502, f"decode {decode.instance_id} failed: {exc}",
                                     decode.instance_id)
        status = resp.status
        if status in RETRY_STATUSES or status >= 500:
            decode.load -= 1
            _record(self.state, decode, status)
            _drop(prefill_call)
            resp.release()
            return Failure(status, first, resp.content_type, decode.instance_id)
        if not stream or status != 200:
            _record(self.state, decode, status)
            decode.load -= 1
            self.state.metrics.latency["decode"].observe(time.perf_counter() - t0)
            resp.release()
            if not stream:
                # Non-streamed: the prefill's outcome decides too (SGLang waits for both).
                if not prefill_call.done():
                    with contextlib.suppress(UpstreamError):
                        await prefill_call
                err = _prefill_error(prefill_call)
                if err is not None:
                    return self._prefill_failure(prefill, err)
            if status == 200:
                self.state.metrics.engine_cached.inc(reported_cached_tokens(first))
            if echo is not None:
                first = echo.whole(first)
            return Response(status, first, resp.content_type, reply)
        err = _prefill_error(prefill_call)
        if err is not None:
            # The decode started streaming but its KV source failed: nothing sent yet, retry.
            decode.load -= 1
            resp.close()
            return self._prefill_failure(prefill, err)
        return await self._stream(request, decode, resp, first, reply, t0, prefill_call,
                                  echo)

    async def _attempt_one(self, request: Request, path: str, worker: Worker, body: bytes,
                           headers: bytes, stream: bool, reply: dict[str, str],
                           echo: RidEcho | None) -> Response | Stream | Failure:
        """One attempt at an aggregated ``worker``, which serves the whole request: retried
        (another worker) on a transport error or a retryable status before its first byte,
        as a decode's is."""
        worker.requests += 1
        worker.load += 1  # counted now so that the very next decision sees it
        t0 = time.perf_counter()
        call = self.upstreams.of(worker).call("POST", path, headers, body, stream=stream)
        relayed = False
        try:
            try:
                resp = await call
                first = await _first_bytes(resp, stream)
            except asyncio.CancelledError:
                _drop(call)
                raise
            except UpstreamError as exc:
                _record(self.state, worker, None, "transport")
                _drop(call)
                return Failure.of_router(502, f"worker {worker.instance_id} failed: {exc}",
                                         worker.instance_id)
            status = resp.status
            if status in RETRY_STATUSES or status >= 500:
                _record(self.state, worker, status)
                resp.release()
                return Failure(status, first, resp.content_type, worker.instance_id)
            if not stream or status != 200:
                _record(self.state, worker, status)
                self.state.metrics.latency[worker.role].observe(time.perf_counter() - t0)
                resp.release()
                if status == 200:
                    self.state.metrics.engine_cached.inc(reported_cached_tokens(first))
                if echo is not None:
                    first = echo.whole(first)
                return Response(status, first, resp.content_type, reply)
            relayed = True  # _stream releases the worker's load
            return await self._stream(request, worker, resp, first, reply, t0, None, echo)
        finally:
            if not relayed:
                worker.load -= 1

    async def _attempt_vllm(self, request: Request, path: str, pair: Pair, parsed: Parsed,
                            headers: dict[str, str], reply: dict[str, str],
                            echo: RidEcho | None, prefill_pages: int
                            ) -> Response | Stream | Failure:
        """One attempt at a vLLM-protocol pair (router/vllm_pd.py), under a request id of its
        own that both halves share: push sends both at once, as a bootstrap pair; pull waits
        for the prefill's answer and hands its ``kv_transfer_params`` to the decode."""
        rid = new_request_id()
        wire = encode_headers({**headers, "x-request-id": rid})
        prefill = pair.prefill.worker
        m = self.state.metrics
        if prefill.protocol.mode == PUSH:
            m.child(m.vllm_pd_requests, PUSH, "given").inc()
            pp = prefill.record.get("pp_size") or 1
            bodies = (prefill_body(parsed), decode_body(
                parsed, prefill.protocol.push_params(engine_request_id(parsed, rid), pp)))
            return await self._attempt(request, path, pair, bodies, wire, parsed.stream,
                                       reply, echo, prefill_pages)
        answer = await self._prefill_first(path, prefill, prefill_body(parsed), wire,
                                           prefill_pages, reply)
        if not isinstance(answer, bytes):
            return answer
        params = answered_params(answer)
        m.child(m.vllm_pd_requests, PULL, "given" if params else "missing").inc()
        if params is None:
            logger.warning("prefill %s answered request %s without kv_transfer_params: its "
                           "decode computes the prompt itself", prefill.instance_id, rid)
        assert pair.decode is not None
        return await self._attempt_one(request, path, pair.decode.worker,
                                       decode_body(parsed, params), wire, parsed.stream,
                                       reply, echo)

    async def _prefill_first(self, path: str, prefill: Worker, body: bytes, headers: bytes,
                             pages: int, reply: dict[str, str]) -> bytes | Response | Failure:
        """A pull-mode prefill's whole answer (bytes) when it succeeded; its own answer to
        relay when it refused the request (4xx: the client's, counted as a success); a
        Failure to retry elsewhere otherwise."""
        prefill.requests += 1
        prefill.load += 1
        t0 = time.perf_counter()
        call = self.upstreams.of(prefill).call("POST", path, headers, body)
        try:
            resp = await call
            answer = resp.take()
        except asyncio.CancelledError:
            _drop(call)  # the client left: closing the call is how the engine learns to abort
            raise
        except UpstreamError as exc:
            _record(self.state, prefill, None, "transport")
            _drop(call)
            return self._prefill_failure(prefill, f"transport error ({exc})")
        finally:
            prefill.load -= 1
            self.state.capacity.give(prefill, pages)
            self.state.metrics.latency["prefill"].observe(time.perf_counter() - t0)
        resp.release()
        _record(self.state, prefill, resp.status)
        if resp.status in RETRY_STATUSES or resp.status >= 500:
            return Failure(resp.status, answer, resp.content_type, prefill.instance_id)
        if resp.status != 200:
            return Response(resp.status, answer, resp.content_type, reply)
        return answer

    def _prefill_failure(self, prefill: Worker, err: str) -> Failure:
        return Failure.of_router(502, f"prefill {prefill.instance_id} failed: {err}",
                                 prefill.instance_id)

    def _prefill_done(self, load: _Counted, t0: float,
                      decode_call: asyncio.Future[UpstreamResponse], pages: int,
                      call: asyncio.Future[UpstreamResponse]) -> None:
        """Bookkeeping of a finished prefill call; a failed one also stops a decode still
        waiting for its answer's head (it would only wait for KV that never comes)."""
        load.end()
        worker = load.worker
        self.state.capacity.give(worker, pages)
        self.state.metrics.latency["prefill"].observe(time.perf_counter() - t0)
        if call.cancelled():
            return
        exc = call.exception()
        if exc is not None:
            _record(self.state, worker, None, "transport")
            decode_call.cancel()
            return
        resp = call.result()
        # The answer is read whole so the connection can be reused; SGLang ignores it.
        resp.release()
        _record(self.state, worker, resp.status)
        if resp.status >= 500:
            decode_call.cancel()

    async def _stream(self, request: Request, decode: Worker, upstream: UpstreamResponse,
                      first: bytes, reply: dict[str, str], t0: float,
                      prefill_call: asyncio.Future[UpstreamResponse] | None,
                      echo: RidEcho | None) -> Stream:
        """Relay ``upstream``'s stream from ``decode`` (a PD decode, or an aggregated worker
        with no ``prefill_call``) to the client."""
        ended = broken = False
        request_id = reply["x-request-id"]
        cached = 0
        try:
            out = await request.stream(upstream.status, upstream.headers.get(
                "content-type", "text/event-stream"), {"cache-control": "no-cache", **reply})
            chunk = first
            while chunk:
                cached = last_cached_tokens(chunk, cached)
                await out.write(chunk if echo is None else echo.chunk(chunk))
                chunk = await upstream.read_chunk()
            if echo is not None:
                await out.write(echo.rest())
            await out.end()
            ended = True
        except UpstreamError as exc:
            broken = True
            logger.warning("stream from decode %s broke after the first byte (not retried): %s",
                           decode.instance_id, exc)
            # Ending the chunked body cleanly would tell the client the answer is complete.
            request.abort()
        except ConnectionResetError:
            # The client went away between two events (a cancellation, the other way the
            # server tells it, goes up through forward, which counts it).
            m = self.state.metrics
            m.child(m.client_disconnects, request.path).inc()
            logger.info("client of %s went away mid-stream", request_id)
        finally:
            decode.load -= 1
            if ended:
                upstream.release()
                _record(self.state, decode, 200)
                self.state.metrics.engine_cached.inc(cached)
            else:
                # Closing both connections is how the engines learn to abort the request.
                upstream.close()
                if prefill_call is not None:
                    _drop(prefill_call)
                if broken:
                    _record(self.state, decode, None, "stream")
            self.state.metrics.latency[decode.role].observe(time.perf_counter() - t0)
        return out


LOCAL_PREFILL_HEADER = "x-kvatlas-prefill"
"""Sent (``local``) with a request a decode serves whole: it prefills the prompt itself."""


def local_headers(headers: dict[str, str]) -> bytes:
    """``headers`` on the wire, asking a decode that prefills locally to serve the request
    whole (its record says ``local_prefill``)."""
    return encode_headers({**headers, LOCAL_PREFILL_HEADER: "local"})


async def _first_bytes(resp: UpstreamResponse, stream: bool) -> bytes:
    """The whole answer, or a stream's first chunk. A streamed call resolves at the head, and
    an error is answered (or retried) whole, not streamed: its body may still be on its way."""
    if not stream:
        return resp.take()
    if resp.status == 200:
        return await resp.read_chunk()
    return await resp.read()


def _prefill_error(call: asyncio.Future[UpstreamResponse]) -> str | None:
    """Why a finished prefill call failed (None while running or when it succeeded)."""
    if not call.done():
        return None
    if call.cancelled():
        return "cancelled"
    exc = call.exception()
    if exc is not None:
        return f"transport error ({exc})"
    status = call.result().status
    return f"status {status}" if status >= 500 else None


def _drop(call: asyncio.Future[UpstreamResponse]) -> None:
    """Abandon a call: cancelling drops its connection; a finished one is closed."""
    if not call.cancel() and not call.cancelled() and call.exception() is None:
        call.result().close()
