"""A lean HTTP/1.1 client for the router's upstream calls: one keep-alive pool per worker.

Each call writes one request on an idle pooled connection (or a new one) and parses the answer
with httptools. A buffered call resolves when the whole answer is in; a streamed call resolves at
the head, and the body is then read chunk by chunk (reading from the worker pauses while the
router holds more than ``STREAM_HIGH_WATER`` unread bytes). A reused connection that the worker
had already closed is retried once on a fresh one, only when no byte of an answer came back.

Every failure is an ``UpstreamError`` naming the worker and what went wrong.
"""
from __future__ import annotations

import asyncio
import ssl as ssl_module
from collections import deque
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from router.errors import RouterError
from router.http.headers import decode_headers, encode_headers

STREAM_HIGH_WATER = 1 << 20


class UpstreamError(RouterError):
    """A call to ``origin`` failed before a complete answer arrived (the dispatcher retries
    elsewhere or answers 502 itself; ``status`` is for one that escaped it)."""

    status = 502

    def __init__(self, origin: str, reason: str) -> None:
        super().__init__(f"{origin}: {reason}")
        self.origin = origin
        self.reason = reason


class UpstreamConnectError(UpstreamError):
    pass


class UpstreamTimeout(UpstreamError):
    pass


class UpstreamClosed(UpstreamError):
    """The connection dropped, or the answer was not HTTP."""


class UpstreamResponse:
    """The answer's status and headers; the body is read with ``read`` or ``read_chunk``."""

    __slots__ = ("status", "_raw", "_headers", "_conn")

    def __init__(self, status: int, raw_headers: list[tuple[bytes, bytes]],
                 conn: _Connection) -> None:
        self.status = status
        self._raw = raw_headers
        self._headers: dict[str, str] | None = None
        self._conn: _Connection | None = conn

    @property
    def headers(self) -> dict[str, str]:
        """Lower-case names; the last of duplicates wins. Built on first use: the router reads
        no header of most answers (a prefill's), so it does not decode them."""
        if self._headers is None:
            self._headers = decode_headers(self._raw)
        return self._headers

    @property
    def content_type(self) -> str:
        for name, value in self._raw:
            if len(name) == 12 and name.lower() == b"content-type":
                return value.decode("latin-1")
        return "application/json"

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while True:
            chunk = await self.read_chunk()
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def read_chunk(self) -> bytes:
        """The body bytes received so far and not yet read (b"" at the end)."""
        return await self._live().read_chunk()

    def take(self) -> bytes:
        """The whole body of a buffered answer (``stream=False``), without waiting."""
        return self._live().take()

    def _live(self) -> _Connection:
        if self._conn is None:
            raise RuntimeError("the answer was already released or closed")
        return self._conn

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if the answer is
        complete, else it is closed. Later calls do nothing."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()

    def close(self) -> None:
        """Drop the connection (an unfinished answer is abandoned). Later calls do nothing."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.busy = False
        self.received = False
        self.complete = False
        self.head_parsed = False
        self.reusable = True
        self.stream = False
        self.head: asyncio.Future[UpstreamResponse] | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.error: UpstreamError | None = None
        self.sent: list[bytes] | None = None
        self.last_read = 0.0

    # --- transport callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its interface.
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        headers = decode_headers(self.raw_headers) if self.head_parsed else {}
        if (self.busy and not self.complete and self.head_parsed and exc is None
                and "content-length" not in headers
                and "chunked" not in headers.get("transfer-encoding", "")):
            # A body without a length ends with the connection (RFC 9112 6.3).
            self.on_message_complete()
            return
        if self.busy and not self.complete:
            self.fail(UpstreamClosed(self.pool.origin, "connection closed before the answer "
                                      "was complete" + (f" ({exc!r})" if exc else "")))

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        if not self.busy:
            # Nothing was asked: an idle connection that talks is not trustworthy.
            self.abort()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamClosed(self.pool.origin, f"malformed HTTP answer ({exc})"))
            self.abort()

    # --- parser callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:
            return  # an interim answer (100 Continue, 103 Early Hints): the real one follows
        self.head_parsed = True
        if self.stream:
            self._resolve_head()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.stream:
            self._wake()
            if self.buffered > STREAM_HIGH_WATER and not self.paused and self.transport:
                self.paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if not self.head_parsed:
            self.raw_headers = []  # the end of an interim answer
            return
        self.complete = True
        if not self.parser.should_keep_alive():
            self.reusable = False
        if self.stream:
            self._wake()
        else:
            self._resolve_head()

    # --- request/answer ---------------------------------------------------------------------

    def send(self, data: list[bytes], stream: bool,
             head: asyncio.Future[UpstreamResponse] | None = None
             ) -> asyncio.Future[UpstreamResponse]:
        """Write one request; ``head`` resolves with the answer (at its head when streamed,
        once complete when buffered). Cancelling ``head`` drops the connection."""
        self.busy = True
        self.sent = data
        self.received = self.complete = self.head_parsed = False
        self.reusable = True
        self.stream = stream
        self.raw_headers = []
        self.chunks.clear()
        self.buffered = 0
        self.error = None
        if head is None:
            head = self.loop.create_future()
        self.head = head
        head.add_done_callback(self._head_done)
        assert self.transport is not None
        # One write of a joined copy: for the small bodies of the data path that is cheaper
        # than writev (the body is copied once; big bodies go out without the join).
        if len(data) == 1:
            self.transport.write(data[0])
        elif len(data[1]) <= 65536:
            self.transport.write(data[0] + data[1])
        else:
            self.transport.writelines(data)
        self.last_read = self.loop.time()
        return self.head

    def _head_done(self, head: asyncio.Future[UpstreamResponse]) -> None:
        if head.cancelled() and self.head is head:
            self.abort()

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        return data

    def _resolve_head(self) -> None:
        if self.head is not None and not self.head.done():
            self.head.set_result(UpstreamResponse(self.parser.get_status_code(),
                                                  self.raw_headers, self))

    async def read_chunk(self) -> bytes:
        while not self.chunks:
            if self.error is not None:
                raise self.error
            if self.complete or self.closed:
                if not self.complete:
                    raise UpstreamClosed(self.pool.origin, "connection closed mid-answer")
                return b""
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            # The worker's silence counts from now: while paused it waited on our client, and
            # a watchdog pass right after the resume must not blame it for that pause.
            self.last_read = self.loop.time()
            self.transport.resume_reading()
        return data

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, error: UpstreamError) -> None:
        self.error = error
        head = self.head
        if head is not None and not head.done():
            if (self.reused and not self.received and isinstance(error, UpstreamClosed)
                    and self.sent is not None and not self.pool.closed):
                # The worker had closed this idle connection: nothing of ours was processed,
                # so the same request goes out once more on a fresh connection.
                self.head = None
                self.pool.resend(self.sent, self.stream, head)
                return
            head.set_exception(error)
        elif self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def silent_for(self, now: float) -> float:
        """Seconds the worker has kept this call waiting (0 when not waiting on the worker:
        idle, complete, or paused because our own client reads slowly)."""
        if not self.busy or self.complete or self.paused or self.closed:
            return 0.0
        return now - self.last_read

    def finish(self) -> None:
        if self.complete and self.reusable and not self.closed and self.error is None:
            self.busy = False
            self.head = None
            self.sent = None
            self.chunks.clear()
            self.pool.give_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            if self.transport is not None:
                self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one worker (``http://host:port`` or ``https://``)."""

    def __init__(self, url: str, *, connect_timeout: float | None = 10.0,
                 read_timeout: float | None = 300.0, max_idle: int = 256,
                 ssl: ssl_module.SSLContext | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL {url!r} must be http://HOST:PORT or https://...")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl_module.SSLContext | None = ssl
        if parts.scheme == "https" and ssl is None:
            self.ssl = ssl_module.create_default_context()
        self.host_header = parts.netloc.encode("idna")
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Connection] = []
        self.active: set[_Connection] = set()
        self.closed = False
        self.close_reason = "the router is shutting down"
        """Why calls fail once ``closed`` (``close``'s reason: the router stops, or the
        worker left)."""
        self._watchdog: asyncio.Task[None] | None = None
        self.connecting: set[asyncio.Task[None]] = set()

    def call(self, method: str, path: str, headers: Mapping[str, str] | bytes, body: bytes,
             *, stream: bool = False) -> asyncio.Future[UpstreamResponse]:
        """Send one request; the future resolves with the answer: whole (``take()`` gives the
        body) when buffered, at its head when ``stream``. No task is made when a pooled
        connection is idle, which is the common case. ``headers`` may come pre-encoded by
        ``encode_headers`` when the same ones go to several workers."""
        if not isinstance(headers, bytes):
            headers = encode_headers(headers)
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            method.encode(), path.encode(), self.host_header, len(body), headers)
        data = [head, body] if body else [head]
        if self.closed:
            fut: asyncio.Future[UpstreamResponse] = self.loop.create_future()
            fut.set_exception(UpstreamClosed(self.origin, self.close_reason))
            return fut
        if self._watchdog is None and self.read_timeout is not None:
            self._watchdog = self.loop.create_task(self._watch(self.read_timeout),
                                                   name=f"upstream-timeouts {self.origin}")
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and conn.transport is not None \
                    and not conn.transport.is_closing():
                conn.reused = True
                self.active.add(conn)
                return conn.send(data, stream)
        fut = self.loop.create_future()
        self.resend(data, stream, fut)
        return fut

    async def request(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
                      *, stream: bool = False) -> UpstreamResponse:
        return await self.call(method, path, headers, body, stream=stream)

    def resend(self, data: list[bytes], stream: bool,
               head: asyncio.Future[UpstreamResponse]) -> None:
        """Send ``data`` on a new connection, answering through ``head``."""
        task = self.loop.create_task(self._connect_and_send(data, stream, head))
        self.connecting.add(task)
        task.add_done_callback(self.connecting.discard)
        # Cancelling the caller's future abandons the connect too.
        head.add_done_callback(lambda f: task.cancel() if f.cancelled() else None)

    async def _connect_and_send(self, data: list[bytes], stream: bool,
                                head: asyncio.Future[UpstreamResponse]) -> None:
        try:
            conn = await self._connect()
        except UpstreamError as exc:
            if not head.done():
                head.set_exception(exc)
            return
        except asyncio.CancelledError:
            if not head.done():
                head.set_exception(UpstreamClosed(self.origin, self.close_reason))
            raise
        if head.done():  # cancelled while connecting
            self.give_back(conn)
            return
        conn.send(data, stream, head)

    async def _connect(self) -> _Connection:
        if self.closed:
            raise UpstreamClosed(self.origin, self.close_reason)
        try:
            _, conn = await asyncio.wait_for(self.loop.create_connection(
                lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout)
        except TimeoutError:
            raise UpstreamConnectError(self.origin, f"connect timed out after "
                                       f"{self.connect_timeout:g} s") from None
        except OSError as exc:
            raise UpstreamConnectError(self.origin, f"cannot connect ({exc})") from None
        if self.closed:
            conn.abort()
            raise UpstreamClosed(self.origin, self.close_reason)
        self.active.add(conn)
        return conn

    async def _watch(self, timeout: float) -> None:
        # One sweep for the whole pool instead of a timer armed and cancelled per call: the
        # deadline is then approximate (up to a quarter of the timeout, at most 1 s late).
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = self.loop.time()
            for conn in list(self.active):
                if conn.silent_for(now) > timeout:
                    conn.fail(UpstreamTimeout(self.origin, f"no data for {timeout:g} s"))
                    conn.abort()

    def give_back(self, conn: _Connection) -> None:
        self.active.discard(conn)
        if self.closed or len(self.idle) >= self.max_idle:
            conn.abort()
        else:
            self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self.active.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self, reason: str = "the router is shutting down") -> None:
        """Drop every connection: idle ones now, busy ones too (their calls fail, for
        ``reason``)."""
        self.closed = True
        self.close_reason = reason
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in self.connecting:
            task.cancel()
        for conn in [*self.idle, *self.active]:
            conn.fail(UpstreamClosed(self.origin, reason))
            conn.abort()
        self.idle.clear()
        self.active.clear()
