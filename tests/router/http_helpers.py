"""Shared pieces of the lean HTTP/1.1 tests (test_http_server*.py, test_http_client*.py).

Server side: the ``serve`` fixture and raw-socket readers for router/http/server.py.
Client side: ``Worker``, a raw asyncio upstream scripted byte by byte, with the ``worker`` and
``pools`` fixtures for router/http/client.py. Test modules bind the fixtures by name
(``serve = http_helpers.serve``)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from router.http.client import UpstreamPool
from router.http.server import HttpServer, Request, Response, Stream, json_response

Handler = Callable[[Request], Awaitable[Response | Stream]]
ServerStarted = Callable[..., Awaitable[tuple[HttpServer, int]]]

Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter


@pytest.fixture
async def serve() -> AsyncIterator[ServerStarted]:
    """``await serve(handler, max_body=..., keepalive_timeout=...)`` -> (server, port)."""
    servers: list[HttpServer] = []

    async def start(handler: Handler, **kw: Any) -> tuple[HttpServer, int]:
        kw.setdefault("max_body", 1 << 20)
        server = HttpServer(handler, **kw)
        port = await server.start("127.0.0.1", 0)
        servers.append(server)
        return server, port

    yield start
    for server in servers:
        await server.close(grace=0.5)


async def echo(request: Request) -> Response:
    return json_response({"method": request.method, "path": request.path,
                          "body": request.body.decode(), "headers": request.headers})


async def read_response(reader: asyncio.StreamReader, timeout: float = 2.0
                        ) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer off a raw socket (content-length or chunked body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 2)
    elif headers.get("transfer-encoding") == "chunked":
        parts = []
        while True:
            size = int((await asyncio.wait_for(reader.readuntil(b"\r\n"), 2)).strip(), 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), 2)
            if size == 0:
                break
            parts.append(chunk[:-2])
        body = b"".join(parts)
    else:
        body = b""
    return status, headers, body


async def at_eof(reader: asyncio.StreamReader, timeout: float = 2.0) -> bool:
    """True when the server closed the connection (nothing more comes) within ``timeout``."""
    try:
        rest = await asyncio.wait_for(reader.read(), timeout)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert rest == b"", f"unexpected bytes after the answer: {rest[:200]!r}"
    return True


async def read_all(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, bool]:
    """Everything the server sends within ``timeout``, and whether it then closed."""
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            more = await asyncio.wait_for(reader.read(65536), deadline - time.monotonic())
            if not more:
                return data, True
            data += more
    except TimeoutError:
        return data, False
    except ConnectionResetError:
        return data, True


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def let_go(server: HttpServer, timeout: float = 30.0) -> None:
    """Until ``server`` holds no connection (an event, under a generous deadline)."""
    deadline = time.monotonic() + timeout
    while server.connections:
        assert time.monotonic() < deadline, f"{len(server.connections)} connections still held"
        await asyncio.sleep(0.01)


# Upstream side (router/http/client.py).


class Worker:
    """A scripted upstream: ``script(worker, conn_no, reader, writer)`` runs per connection.

    Counts connections, the requests read (``requests``: (conn_no, request line, headers,
    body)) and records each connection's end as seen from the worker (``closed``)."""

    def __init__(self, script: Callable[[Worker, int, Reader, Writer], Awaitable[None]]) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[tuple[int, str, dict[str, str], bytes]] = []
        self.closed: list[asyncio.Event] = []
        self.got_request = asyncio.Event()
        self.server: asyncio.base_events.Server | None = None
        self.url = ""

    async def start(self) -> Worker:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _conn(self, reader: Reader, writer: Writer) -> None:
        self.connections += 1
        done = asyncio.Event()
        self.closed.append(done)
        try:
            await self.script(self, self.connections, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            done.set()

    async def read_request(self, conn_no: int, reader: Reader) -> bool:
        """Read one request; False at EOF."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return False
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        self.requests.append((conn_no, lines[0], headers, body))
        self.got_request.set()
        return True

    async def wait_eof(self, reader: Reader, timeout: float = 2.0) -> bool:
        """True when the client closed (or reset) this connection within ``timeout``."""
        try:
            return await asyncio.wait_for(reader.read(), timeout) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()


WorkerStarted = Callable[[Callable[[Worker, int, Reader, Writer], Awaitable[None]]],
                        Awaitable[Worker]]


@pytest.fixture
async def worker() -> AsyncIterator[WorkerStarted]:
    made: list[Worker] = []

    async def start(script: Callable[[Worker, int, Reader, Writer], Awaitable[None]]) -> Worker:
        w = await Worker(script).start()
        made.append(w)
        return w

    yield start
    for w in made:
        await w.stop()


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., UpstreamPool]]:
    made: list[UpstreamPool] = []

    def make(url: str, **kw: float) -> UpstreamPool:
        pool = UpstreamPool(url, **kw)  # type: ignore[arg-type]
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def answer(body: bytes, status: str = "200 OK", extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status.encode(), len(body), extra, body))


async def keep_alive(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
    """A well-behaved worker: answers every request with its request line, keeps alive."""
    while await w.read_request(n, reader):
        writer.write(answer(w.requests[-1][1].encode()))
        await writer.drain()


async def hang_or_ok(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
    """A worker script: ``GET /hang...`` is never answered (the worker waits for the client to
    close), anything else gets ``ok``."""
    while await w.read_request(n, reader):
        if w.requests[-1][1].startswith("GET /hang"):
            await w.wait_eof(reader, timeout=5)
            return
        writer.write(answer(b"ok"))
        await writer.drain()
