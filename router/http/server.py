"""A lean HTTP/1.1 server for the router: httptools parsing, keep-alive, pipelining, streaming.

Why not aiohttp here: the router's whole job is to parse one request and write one answer, and
aiohttp's per-request machinery (request/response objects, payload registry, middlewares) cost
more CPU than the routing itself; ``bench/router.py`` measures the difference. Everything else in
kvatlas stays on aiohttp.

A handler is ``async def handler(request) -> Response | Stream``. Requests on one connection are
answered in order; one that arrives while another is in flight waits in a queue. When the client
goes away, the in-flight handler is cancelled, so that its upstream work is abandoned too.
Protocol mistakes (malformed HTTP, a body over the limit, oversized headers) get a JSON 4xx and
the connection is closed; a handler that raises gets a JSON 500 and the error is logged.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qsl

import httptools

from router.http.headers import header_name

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10
LINGER_S = 2.0
"""How long a refused connection is drained after its error answer before it is closed."""
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def _head(status: int, content_type: str | None, length: int | None,
          headers: dict[str, str] | None, close: bool, chunked: bool = True) -> bytes:
    """A response head; ``length`` None means a streamed body: chunked, or (HTTP/1.0 client)
    delimited by closing the connection."""
    line = _STATUS_LINES.get(status)
    parts = [line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status]
    if content_type is not None:
        parts.append(b"content-type: %s\r\n" % content_type.encode("latin-1"))
    if length is None:
        if chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    if headers:
        for name, value in headers.items():
            parts.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


class _StopParsing(Exception):
    """Raised from a parser callback to stop parsing the rest of the buffer."""


class Request:
    """One parsed request; ``headers`` has lower-case names (the last of duplicates wins)."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "keep_alive", "http10",
                 "_conn", "_query")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str],
                 body: bytes, keep_alive: bool, conn: HttpProtocol,
                 http10: bool = False) -> None:
        self.http10 = http10
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self._conn = conn
        self._query: dict[str, str] | None = None

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    def abort(self) -> None:
        """Drop the connection without finishing the answer (a broken upstream stream must
        not look complete to the client)."""
        self._conn.close()

    async def stream(self, status: int, content_type: str,
                     headers: dict[str, str] | None = None) -> Stream:
        """Send the head of a streamed answer now; the handler writes the body and returns it.
        Chunked for HTTP/1.1; an HTTP/1.0 client knows no chunks, so its body ends with the
        connection."""
        chunked = not self.http10
        if not chunked:
            self.keep_alive = False
        stream = Stream(self._conn, chunked)
        self._conn.streaming = True
        self._conn.write(_head(status, content_type, None, headers, not chunked, chunked))
        return stream


class Response:
    """A complete answer."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int = 200, body: bytes = b"",
                 content_type: str = "application/json",
                 headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


def json_response(data: Any, status: int = 200,
                  headers: dict[str, str] | None = None) -> Response:
    return Response(status, json.dumps(data).encode(), "application/json", headers)


class Stream:
    """The body of a streamed answer. ``write`` waits while the client is not reading, and
    raises ``ConnectionResetError`` once the client has gone away."""

    __slots__ = ("_conn", "ended", "chunked")

    def __init__(self, conn: HttpProtocol, chunked: bool = True) -> None:
        self._conn = conn
        self.ended = False
        self.chunked = chunked

    async def write(self, data: bytes) -> None:
        if not data:
            return
        conn = self._conn
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        await conn.drain()

    async def end(self) -> None:
        if not self.ended:
            self.ended = True
            if self.chunked:
                self._conn.write(b"0\r\n\r\n")
            await self._conn.drain()


Handler = Callable[[Request], Awaitable["Response | Stream"]]


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        assert server.loop is not None
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        """Serves this connection's requests in order, for as long as it is open."""
        self.busy = False
        self._wakeup: asyncio.Future[None] | None = None
        self.closing = False
        self.streaming = False
        """The current answer's head went out as a stream: an error now can only cut it."""
        self.in_head = False
        self.head_bytes = 0
        self.ignore_rest = False
        self.last_active = time.monotonic()
        self.receiving_since: float | None = None
        """When the request being received began (None between requests)."""
        self._paused: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0

    # --- transport callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its interface.
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self._paused is not None and not self._paused.done():
            # A result, not an exception: nobody may be waiting, and drain() checks closing.
            self._paused.set_result(None)

    def pause_writing(self) -> None:
        if self._paused is None or self._paused.done():
            self._paused = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._paused is not None and not self._paused.done():
            self._paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.closing or self.ignore_rest:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError:
            pass  # a callback already answered and closed
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed HTTP request ({exc})")
        if self.in_head and not self.closing:
            # Still inside a head after this read: httptools buffers a partial header line or
            # request target without a bound, so the reads themselves are counted. (A read
            # may also hold earlier pipelined requests: hence the margin.)
            self.head_bytes += len(data)
            if self.head_bytes > 2 * MAX_HEADER_BYTES:
                self._fail(431, f"request headers over {MAX_HEADER_BYTES} bytes")

    # --- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.receiving_since = self.last_active
        self.in_head = True
        self.head_bytes = 0
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._fail(431, f"request headers over {MAX_HEADER_BYTES} bytes")
            raise ValueError("headers too large")
        self._headers[header_name(name)] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.in_head = False
        length = self._headers.get("content-length")
        limit = self.server.max_body
        if length is not None and length.isdigit() and int(length) > limit:
            self._too_large()
            raise ValueError("body too large")
        if self._headers.get("expect", "").lower() == "100-continue":
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body:
            self._too_large()
            raise ValueError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.receiving_since = None
        try:
            url = httptools.parse_url(self._url)
        except httptools.HttpParserInvalidURLError:
            self._fail(400, "malformed request target")
            raise ValueError("bad url") from None
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        parser = self.parser
        request = Request(parser.get_method().decode("latin-1"), url.path.decode("latin-1"),
                          url.query.decode("latin-1") if url.query else "", self._headers, body,
                          parser.should_keep_alive(), self, parser.get_http_version() == "1.0")
        self.queue.append(request)
        if self.task is None:
            # The server's loop, not asyncio.get_running_loop(): on CPython 3.11 that costs a
            # getpid() syscall per call.
            self.task = self.loop.create_task(self._serve())
        elif self._wakeup is not None and not self._wakeup.done():
            # One task per connection, woken per request: cheaper than a task per request.
            self._wakeup.set_result(None)
        if not request.keep_alive:
            # Whatever follows on this connection is ignored (RFC 9112 9.6): stop the parser.
            self.ignore_rest = True
            raise _StopParsing

    # --- answering --------------------------------------------------------------------------

    async def _serve(self) -> None:
        handler = self.server.handler
        try:
            while not self.closing:
                if not self.queue:
                    self.busy = False
                    self.last_active = time.monotonic()
                    self._wakeup = self.loop.create_future()
                    await self._wakeup
                    self._wakeup = None
                    continue
                self.busy = True
                request = self.queue.popleft()
                self.streaming = False
                try:
                    answer = await handler(request)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the client always gets an answer
                    if self.closing and isinstance(exc, ConnectionResetError):
                        return  # the client went away mid-answer
                    logger.exception("unhandled error on %s %s", request.method, request.path)
                    if self.streaming:
                        # Part of a chunked body went out: ending it would pass for complete.
                        self.close()
                        return
                    answer = json_response({"error": "internal router error (see its log)"},
                                           500)
                # A stopping server ends each connection after its answer in flight.
                close = not request.keep_alive or self.server.stopping
                if isinstance(answer, Stream):
                    if self.closing:
                        return
                    if not answer.ended:
                        try:
                            await answer.end()
                        except ConnectionResetError:
                            return
                else:
                    self.write(_head(answer.status, answer.content_type, len(answer.body),
                                     answer.headers, close) + answer.body)
                if close:
                    self.close()
                    return
        finally:
            self.task = None
            self.busy = False
            self.last_active = time.monotonic()

    def write(self, data: bytes) -> None:
        if not self.closing and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closing:
            raise ConnectionResetError("client went away")
        paused = self._paused
        if paused is not None and not paused.done():
            await paused
            if self.closing:
                raise ConnectionResetError("client went away")

    def close(self) -> None:
        # Also ends a lingering close at once (closing is already set then).
        if self.transport is not None and not self.transport.is_closing():
            self.closing = True
            self.transport.close()

    def _linger(self) -> None:
        """Half-close, then drain what the client still sends for a while before closing.

        Closing with unread input makes the kernel send a reset, which can destroy the error
        answer before the client reads it; a client still sending its body or headers is
        exactly that case (the "lingering close" of RFC 9112, 9.6)."""
        transport = self.transport
        self.closing = True  # from here on, data_received discards
        self.receiving_since = None
        if transport is None:
            return
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def _too_large(self) -> None:
        limit = self.server.max_body
        self._fail(413, f"body too large: the limit is {limit} bytes{self.server.limit_hint}")

    def _fail(self, status: int, message: str) -> None:
        """Answer a protocol-level mistake and close: the byte stream can't be trusted now."""
        if self.closing:
            return
        body = json.dumps({"error": message}).encode()
        self.write(_head(status, "application/json", len(body), None, True) + body)
        self._linger()
        if self.server.on_reject is not None:
            self.server.on_reject(status)


class HttpServer:
    """Listens and hands each request to ``handler``; idle keep-alive connections are closed
    after ``keepalive_timeout`` seconds, and a request not received whole within
    ``read_timeout`` seconds of its first byte gets a 408."""

    def __init__(self, handler: Handler, *, max_body: int, keepalive_timeout: float = 75.0,
                 read_timeout: float = 60.0, limit_hint: str = "",
                 on_reject: Callable[[int], None] | None = None) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_timeout = keepalive_timeout
        self.read_timeout = read_timeout
        self.limit_hint = limit_hint
        self.on_reject = on_reject
        """Told the status of every request refused before reaching the handler (413, 431,
        400 ...), so that they can be counted too."""
        self.connections: set[HttpProtocol] = set()
        self.stopping = False
        """Set by ``close``: answers in flight end their connections."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        self.loop = loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: HttpProtocol(self), host, port,
                                                reuse_address=True, backlog=1024)
        self._sweeper = loop.create_task(self._sweep(), name="http-idle-sweep")
        return int(self._server.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        # One timer for all connections, instead of re-arming one per request.
        while True:
            await asyncio.sleep(min(5.0, self.keepalive_timeout / 2, self.read_timeout / 2))
            now = time.monotonic()
            idle_cutoff = now - self.keepalive_timeout
            read_cutoff = now - self.read_timeout
            for conn in list(self.connections):
                since = conn.receiving_since
                if since is not None and since < read_cutoff and not conn.busy:
                    # Judged from the first byte, not the last: bytes trickled in one at a
                    # time would otherwise keep the connection for ever. (Not while an earlier
                    # pipelined request is answered: the 408 would pass for its answer.)
                    conn._fail(408, f"request not received within {self.read_timeout:g} s")
                elif not conn.busy and conn.last_active < idle_cutoff:
                    conn.close()

    async def close(self, grace: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` s, then close.

        Idle keep-alive connections close at once and busy ones after their answer: new
        requests on them would otherwise keep the server busy to the end of the grace."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if not conn.busy:
                conn.close()
        deadline = time.monotonic() + grace
        while any(c.busy for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
