"""The router's lean HTTP/1.1 server (router/http/server.py) on real loopback sockets:
streamed answers, client disconnects, keep-alive timeouts and graceful close.

Protocol basics are in test_http_server.py; shared helpers in http_helpers.py."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import http_helpers
import pytest
from http_helpers import ServerStarted as Started
from http_helpers import at_eof, connect, echo, let_go, read_all, read_response
from waiting import wait_until

from router.http.server import Request, Response, Stream, json_response

serve = http_helpers.serve  # the fixture


async def test_handler_error_after_stream_head_aborts_connection(serve: Started) -> None:
    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "text/plain")
        await stream.write(b"partial")
        raise RuntimeError("upstream broke mid-stream")

    _, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    data, closed = await read_all(reader, 0.5)
    assert data.startswith(b"HTTP/1.1 200 ")
    assert b"7\r\npartial\r\n" in data
    # The body must look broken (no terminating chunk, connection dropped), not carry another
    # HTTP answer inside it.
    assert b"HTTP/1.1 500" not in data
    assert not data.endswith(b"0\r\n\r\n")
    assert closed


async def test_stream_delivers_each_chunk_as_written(serve: Started) -> None:
    may_continue = asyncio.Event()
    wrote_second = asyncio.Event()

    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "text/event-stream", {"x-kind": "sse"})
        await stream.write(b"data: one\n\n")
        await may_continue.wait()
        await stream.write(b"data: two\n\n")
        wrote_second.set()
        return stream

    _, port = await serve(handler)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/s") as resp:
            assert resp.status == 200
            assert resp.headers["content-type"] == "text/event-stream"
            assert resp.headers["x-kind"] == "sse"
            assert resp.headers["transfer-encoding"] == "chunked"
            first = await asyncio.wait_for(resp.content.readany(), 2)
            assert first == b"data: one\n\n"
            assert not wrote_second.is_set()
            may_continue.set()
            assert await asyncio.wait_for(resp.content.read(), 2) == b"data: two\n\n"
        # The server ended the stream itself; the connection is reused afterwards.
        async with session.get(f"http://127.0.0.1:{port}/s") as resp:
            assert await asyncio.wait_for(resp.read(), 2) == b"data: one\n\ndata: two\n\n"


@pytest.mark.parametrize("keep_alive", [False, True])
async def test_http10_client_gets_a_close_delimited_stream(serve: Started,
                                                           keep_alive: bool) -> None:
    # HTTP/1.0 has no chunked encoding: the body is raw and ends with the connection, even
    # when the client asked to keep it alive.
    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "text/plain")
        await stream.write(b"one ")
        await stream.write(b"two")
        return stream

    _, port = await serve(handler)
    reader, writer = await connect(port)
    extra = b"connection: keep-alive\r\n" if keep_alive else b""
    writer.write(b"GET / HTTP/1.0\r\nhost: x\r\n" + extra + b"\r\n")
    data, closed = await read_all(reader, 2.0)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert body == b"one two" and closed


async def test_client_disconnect_cancels_handler(serve: Started) -> None:
    started = asyncio.Event()
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def handler(request: Request) -> Response:
        started.set()
        try:
            await asyncio.sleep(30)  # a handler still working: what is tested is its cancel
        except asyncio.CancelledError:
            outcome.set_result("cancelled")
            raise
        outcome.set_result("finished")
        return json_response({})

    server, port = await serve(handler)
    _, writer = await connect(port)
    writer.write(b"GET /long HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(started.wait(), 2)
    writer.close()
    assert await asyncio.wait_for(outcome, 30) == "cancelled"
    await let_go(server)


async def test_idle_keep_alive_connection_is_closed_after_timeout(serve: Started) -> None:
    answered: list[float] = []

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            await asyncio.sleep(0.35)  # longer than the keep-alive timeout: must not be cut
        answered.append(time.monotonic())  # the connection is idle from just after this
        return json_response({"path": request.path})

    server, port = await serve(handler, keepalive_timeout=0.2)
    reader, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = await read_response(reader, timeout=10)
    assert status == 200 and json.loads(body)["path"] == "/slow"
    # The close may come late on a loaded box, but never within the timeout of the answer.
    assert await at_eof(reader, timeout=10)
    assert time.monotonic() - answered[0] >= 0.2
    assert not server.connections


async def test_silent_connection_is_closed_after_keepalive_timeout(serve: Started) -> None:
    server, port = await serve(echo, keepalive_timeout=0.2)
    t0 = time.monotonic()  # before the server could count the connection as active
    reader, _ = await connect(port)
    assert await at_eof(reader, timeout=10)
    assert time.monotonic() - t0 >= 0.2


async def test_a_trickled_request_gets_408_from_its_first_byte(serve: Started) -> None:
    rejected: list[int] = []
    server, port = await serve(echo, keepalive_timeout=30, read_timeout=0.4,
                               on_reject=rejected.append)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-slow: ")
    t0 = time.monotonic()  # before the server read the first byte
    answer = asyncio.ensure_future(read_response(reader, timeout=30))
    while not answer.done():
        # A byte every 50 ms until the answer comes: never idle, never complete. A clock run
        # from the last byte would never fire, so any 408 at all is timed from the first.
        writer.write(b"a")
        await asyncio.sleep(0.05)
    status, _, body = await answer
    assert status == 408 and "not received within 0.4 s" in json.loads(body)["error"]
    assert time.monotonic() - t0 >= 0.4
    assert await at_eof(reader, timeout=30) and rejected == [408]
    writer.close()  # the server drained the rest while it lingered; now it lets go
    await let_go(server)


async def test_a_slow_but_whole_request_is_served(serve: Started) -> None:
    _, port = await serve(echo, read_timeout=1.0)
    reader, writer = await connect(port)
    for piece in (b"POST /p HTTP/1.1\r\nhost: x\r\n", b"content-length: 2\r\n\r\n", b"ok"):
        writer.write(piece)
        await asyncio.sleep(0.1)  # slow on purpose: a slow client is the thing tested
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "ok"
    writer.close()


async def test_no_408_while_an_earlier_pipelined_request_is_answered(serve: Started) -> None:
    async def handler(request: Request) -> Response:
        await asyncio.sleep(0.8)  # longer than the read timeout
        return json_response({"path": request.path})

    _, port = await serve(handler, read_timeout=0.3)
    reader, writer = await connect(port)
    writer.write(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\nGET /second HTTP/1.1\r\nho")
    status, _, body = await read_response(reader, timeout=3)
    assert status == 200 and json.loads(body)["path"] == "/first"
    # The second request has been arriving for longer than the timeout: it is the one refused.
    status, _, _ = await read_response(reader, timeout=3)
    assert status == 408
    assert await at_eof(reader)


async def test_close_ends_keep_alive_connections_instead_of_serving_on(serve: Started) -> None:
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            await release.wait()
        return json_response({"path": request.path})

    server, port = await serve(handler)
    idle_reader, idle_writer = await connect(port)
    idle_writer.write(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await read_response(idle_reader))[0] == 200  # kept alive, now idle
    busy_reader, busy_writer = await connect(port)
    busy_writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
    while not any(c.busy for c in server.connections):
        await asyncio.sleep(0.005)
    closing = asyncio.ensure_future(server.close(grace=120))
    # The idle one at once: while the busy one is still held, not after it.
    assert await at_eof(idle_reader, timeout=30)
    assert not closing.done()
    release.set()
    status, headers, _ = await read_response(busy_reader, timeout=30)
    assert status == 200 and headers["connection"] == "close"  # the busy one after its answer
    assert await at_eof(busy_reader, timeout=30)
    # Done once its connections are: a close that waited out the grace would time out here.
    await asyncio.wait_for(closing, 30)
    for w in (idle_writer, busy_writer):
        w.close()


async def test_close_waits_for_in_flight_request(serve: Started) -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        await release.wait()
        return json_response({"done": True})

    server, port = await serve(handler)
    idle_reader, _ = await connect(port)
    reader, writer = await connect(port)
    writer.write(b"GET /work HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(started.wait(), 2)
    closing = asyncio.create_task(server.close(grace=5))
    await asyncio.sleep(0.15)  # a chance to end early, which it must not take: not a wait
    assert not closing.done()
    with pytest.raises(OSError):  # no longer accepting
        await connect(port)
    release.set()
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body) == {"done": True}
    await asyncio.wait_for(closing, 2)
    assert await at_eof(reader) and await at_eof(idle_reader)


async def test_close_gives_up_after_grace(serve: Started) -> None:
    started = asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        await asyncio.Event().wait()  # never answers: only the grace can end the close
        return json_response({})

    server, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(started.wait(), 2)
    t0 = time.monotonic()
    # The grace is the behaviour under test: it ends the close (the outer wait is only a
    # generous bound), and not before it has passed.
    await asyncio.wait_for(server.close(grace=0.2), 30)
    assert time.monotonic() - t0 >= 0.2
    assert await at_eof(reader, timeout=30)


async def test_stream_write_waits_for_a_slow_client(serve: Started) -> None:
    piece = b"z" * (1 << 20)
    total = 48
    written: list[int] = []

    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "application/octet-stream")
        for i in range(total):
            await stream.write(piece)
            written.append(i)
        return stream

    _, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.sleep(0.3)  # not reading
    # write() blocked once the transport's buffer filled instead of buffering everything.
    assert len(written) < total // 2, len(written)
    status, _, body = await read_response(reader, timeout=5)
    assert status == 200 and len(body) == len(piece) * total
    assert len(written) == total
    writer.close()


async def test_client_gone_while_stream_write_is_blocked(serve: Started) -> None:
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "application/octet-stream")
        try:
            while True:
                await stream.write(b"z" * (1 << 20))
        except (asyncio.CancelledError, ConnectionResetError) as exc:
            outcome.set_result(type(exc).__name__)
            raise

    server, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    # The handler's writes fill the buffers and block (the transport paused its writing).
    await wait_until(lambda: any(c._paused is not None and not c._paused.done()
                                 for c in server.connections),
                     what="the stream's writes block on full buffers")
    writer.transport.abort()
    assert await asyncio.wait_for(outcome, 30) in ("CancelledError", "ConnectionResetError")
    await let_go(server)


async def test_a_stream_to_a_client_that_reads_nothing_is_cut(serve: Started) -> None:
    """A client that stops reading a stream is cut after the keep-alive timeout: its handler's
    write raises ConnectionResetError (the router then drops the decode's request, whose pages
    a paused stream would otherwise hold for as long as the client likes)."""
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def handler(request: Request) -> Stream:
        stream = await request.stream(200, "text/event-stream")
        try:
            while True:
                await stream.write(b"z" * (1 << 20))
        except ConnectionResetError as exc:
            outcome.set_result(str(exc))
            raise

    server, port = await serve(handler, keepalive_timeout=0.3)
    _, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert await asyncio.wait_for(outcome, 30) == "client read nothing for 0.3 s"
    await let_go(server)
    writer.close()

