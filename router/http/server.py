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

import httptools

from router.errors import error_body, openai_route
from router.http.headers import header_name
from router.http.messages import Request, Response, Stream, json_response, response_head

__all__ = ["HttpServer", "Request", "Response", "Stream", "json_response"]

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 << 10
MAX_AHEAD_BYTES = 1 << 20
"""Bytes of pipelined requests (bodies and headers, a partly received one included) a
connection holds beyond the one being answered; past it the server stops reading until the
answers catch up. Requests are answered in order, so reading further ahead only costs memory
(8 pipelined 20 MB bodies held 160 MB and more)."""
MAX_AHEAD_REQUESTS = 64
"""Pipelined requests parsed ahead of the one being answered, at most (then reading pauses)."""
LINGER_S = 2.0
"""How long a refused connection is drained after its error answer before it is closed."""


class _StopParsing(Exception):
    """Raised from a parser callback to stop parsing the rest of the buffer."""


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
        self.reading_paused = False
        """Reading stopped: pipelined requests ahead of the answers are past the bounds."""
        self.queued_bytes = 0
        """Bytes of the requests in ``queue`` (bodies and headers)."""
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
        if (self.busy or self.queue) and not self.reading_paused:
            self._check_ahead()

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
        request.size += self._header_bytes
        self.queue.append(request)
        self.queued_bytes += request.size
        if not self.reading_paused and (self.queued_bytes > MAX_AHEAD_BYTES
                                        or len(self.queue) > MAX_AHEAD_REQUESTS):
            self._check_ahead()
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

    # --- reading ahead ----------------------------------------------------------------------

    @property
    def ahead_bytes(self) -> int:
        """Bytes held for requests not being answered: those queued, and the one being
        received unless it is next (nothing before it is queued or being answered)."""
        receiving = self._body_bytes + self._header_bytes if self.receiving_since else 0
        return self.queued_bytes + (receiving if self.busy or self.queue else 0)

    def _check_ahead(self) -> None:
        """Pause reading while what is held ahead is past the bounds; resume once it is not."""
        over = self.ahead_bytes > MAX_AHEAD_BYTES or len(self.queue) > MAX_AHEAD_REQUESTS
        if over == self.reading_paused or self.closing or self.transport is None:
            return
        self.reading_paused = over
        if over:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()
            if self.receiving_since is not None:
                # The wait was the server's: the client's time to send runs from now.
                self.receiving_since = time.monotonic()

    # --- answering --------------------------------------------------------------------------

    async def _serve(self) -> None:
        handler = self.server.handler
        try:
            while not self.closing:
                if not self.queue:
                    self.busy = False
                    if self.reading_paused:
                        self._check_ahead()
                    self.last_active = time.monotonic()
                    self._wakeup = self.loop.create_future()
                    await self._wakeup
                    self._wakeup = None
                    continue
                self.busy = True
                request = self.queue.popleft()
                self.queued_bytes -= request.size
                if self.reading_paused:
                    self._check_ahead()
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
                    answer = json_response(error_body(
                        500, "internal router error (see its log)",
                        openai=openai_route(request.path)), 500)
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
                    head = response_head(answer.status, answer.content_type, len(answer.body),
                                         answer.headers, close)
                    # HEAD: the very head of the GET answer, without its body (RFC 9110 9.3.2).
                    self.write(head if request.method == "HEAD" else head + answer.body)
                if close:
                    self.close()
                    return
                paused = self._paused
                if paused is not None and not paused.done():
                    # The client is not reading its answers: answering the requests it
                    # pipelined behind would only pile answers up here (40-byte requests for
                    # 1 MiB answers), so wait; reading stops too once those are past the bounds.
                    try:
                        await self.drain()
                    except ConnectionResetError:
                        return
        finally:
            self.task = None
            self.busy = False
            self.last_active = time.monotonic()

    def write(self, data: bytes) -> None:
        if not self.closing and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the client is not reading; ConnectionResetError once it has gone, or
        when it read nothing for the keep-alive timeout (it is cut then, as an idle one is:
        a stream to it would hold a decode's request, and its pages, for as long)."""
        if self.closing:
            raise ConnectionResetError("client went away")
        paused = self._paused
        if paused is not None and not paused.done():
            try:
                await asyncio.wait_for(paused, self.server.keepalive_timeout)
            except TimeoutError:
                self.closing = True
                if self.transport is not None:
                    self.transport.abort()  # a close would wait to flush what it never reads
                raise ConnectionResetError(f"client read nothing for "
                                           f"{self.server.keepalive_timeout:g} s") from None
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
            if self.reading_paused:
                # Paused for the requests read ahead (a refusal can come in the same read):
                # draining needs reading.
                self.reading_paused = False
                transport.resume_reading()
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
        # In the shape of the route it was sent to, as far as its head came in.
        openai = openai_route(self._url.decode("latin-1"))
        body = json.dumps(error_body(status, message, openai=openai)).encode()
        self.write(response_head(status, "application/json", len(body), None, True) + body)
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
