"""The router's lean HTTP/1.1 server (router/http/server.py) on real loopback sockets:
protocol basics (keep-alive, pipelining, 100-continue, size limits, malformed input, handler
errors, connection closes, query and header handling).

Driven by aiohttp.ClientSession where a well-behaved client is enough, and by raw
asyncio.open_connection sockets where the bytes on the wire matter. Streaming, disconnects,
timeouts and server close are in test_http_server_streams.py."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import http_helpers
import pytest
from http_helpers import ServerStarted as Started
from http_helpers import at_eof, connect, echo, let_go, read_response
from waiting import wait_until

from router.http.server import MAX_AHEAD_BYTES, MAX_HEADER_BYTES, Request, Response, json_response

serve = http_helpers.serve  # the fixture


async def test_keep_alive_serves_many_requests_on_one_connection(serve: Started) -> None:
    server, port = await serve(echo)
    seen: set[int] = set()
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i in range(6):
            async with session.post(f"http://127.0.0.1:{port}/n{i}", data=b"x" * i) as resp:
                assert resp.status == 200
                assert resp.headers["content-type"] == "application/json"
                got = await resp.json()
            assert got["path"] == f"/n{i}" and got["body"] == "x" * i
            seen.update(id(c) for c in server.connections)
    assert len(seen) == 1

    # The same on a raw socket: three requests in turn, one connection, answers complete.
    reader, writer = await connect(port)
    for i in range(3):
        writer.write(b"GET /raw%d HTTP/1.1\r\nhost: x\r\n\r\n" % i)
        status, headers, body = await read_response(reader)
        assert status == 200 and json.loads(body)["path"] == f"/raw{i}"
        assert "connection" not in headers
    writer.close()


async def test_pipelined_requests_are_answered_in_order(serve: Started) -> None:
    order: list[str] = []

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            await asyncio.sleep(0.1)  # slow on purpose: what is tested is that none overtakes it
        order.append(request.path)
        return json_response({"path": request.path, "body": request.body.decode()})

    _, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
                 b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
                 b"GET /c HTTP/1.1\r\nhost: x\r\n\r\n")
    answers = [json.loads((await read_response(reader))[2]) for _ in range(3)]
    assert [a["path"] for a in answers] == ["/slow", "/b", "/c"]
    assert answers[1]["body"] == "abc"
    # One at a time: /b waited for /slow instead of overtaking it.
    assert order == ["/slow", "/b", "/c"]
    writer.close()


async def test_pipelined_bodies_wait_in_the_socket_not_in_the_server(serve: Started) -> None:
    """Answers go out in order, so bodies read far ahead of them only cost memory (8 pipelined
    20 MB bodies once held 323 MB): past MAX_AHEAD_BYTES the server stops reading."""
    release = asyncio.Event()
    ahead: list[int] = []  # bytes the server held ahead of each request as it was answered
    queued: list[int] = []  # bytes of the requests queued behind it then
    slack = (256 << 10) + 200  # one read (asyncio's and uvloop's size) and a head

    async def handler(request: Request) -> Response:
        (conn,) = server.connections
        ahead.append(getattr(conn, "ahead_bytes", 0))
        queued.append(sum(len(r.body) for r in conn.queue))
        await release.wait()
        return json_response({"path": request.path, "n": len(request.body)})

    server, port = await serve(handler, max_body=4 << 20)
    reader, writer = await connect(port)
    body = b"x" * (2 << 20)
    for i in range(8):
        writer.write(b"POST /r%d HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
                     % (i, len(body)) + body)
    sent = asyncio.ensure_future(writer.drain())

    async def paused() -> None:
        while not (server.connections
                   and getattr(next(iter(server.connections)), "reading_paused", False)):
            await asyncio.sleep(0.01)

    pause = asyncio.ensure_future(paused())
    # Without a bound the server reads everything and the client's drain ends.
    await asyncio.wait([sent, pause], timeout=30, return_when=asyncio.FIRST_COMPLETED)
    (conn,) = server.connections
    queued.append(sum(len(r.body) for r in conn.queue))
    assert pause.done() and not sent.done(), f"read everything: {queued[-1]} bytes queued"
    assert queued[-1] == 0 and conn.ahead_bytes <= MAX_AHEAD_BYTES + slack, conn.ahead_bytes
    release.set()
    for i in range(8):
        status, _, got = await read_response(reader, timeout=30)
        assert status == 200 and json.loads(got) == {"path": f"/r{i}", "n": len(body)}
    await sent
    assert len(ahead) == 8 and max(ahead) <= MAX_AHEAD_BYTES + slack, ahead
    assert max(queued) <= MAX_AHEAD_BYTES + slack, queued
    assert not conn.reading_paused
    writer.close()


async def test_answers_wait_for_a_client_that_does_not_read_them(serve: Started) -> None:
    """Pipelined requests are bounded, and so are their answers: a client that sends many
    small requests for large answers and reads none must not have the server answer them all
    into memory (40 requests of 40 bytes here, 40 MiB of answers)."""
    answer = b"a" * (1 << 20)
    handled: list[str] = []

    async def handler(request: Request) -> Response:
        handled.append(request.path)
        return Response(200, answer, "application/octet-stream")

    _, port = await serve(handler)
    reader, writer = await connect(port)
    n = 40
    writer.write(b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(n)))
    while not handled:
        await asyncio.sleep(0)
    # The server answers until the socket's buffers are full, then waits for the client:
    # answered all at once, they were all in the server's write buffer by now.
    assert len(handled) < n // 2, len(handled)
    for i in range(n):
        status, _, body = await read_response(reader, timeout=30)
        assert status == 200 and body == answer, i
    assert handled == [f"/{i}" for i in range(n)]
    writer.close()


async def test_a_client_that_reads_no_answer_is_cut_after_the_keep_alive_timeout(
        serve: Started) -> None:
    handled: list[str] = []

    async def handler(request: Request) -> Response:
        handled.append(request.path)
        return Response(200, b"a" * (1 << 20), "application/octet-stream")

    server, port = await serve(handler, keepalive_timeout=0.3)
    _, writer = await connect(port)
    n = 40
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * n)
    await wait_until(lambda: server.connections, what="the server holds the connection")
    await let_go(server)  # it never reads: the server lets go of it all the same
    # Cut while its answers wait in full buffers: the requests behind them were never served.
    assert 0 < len(handled) < n, len(handled)
    assert not server.connections
    writer.close()


async def test_head_gets_the_get_head_and_no_body(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    # Pipelined behind it, a GET: its answer must come right after the HEAD's head.
    writer.write(b"HEAD /h HTTP/1.1\r\nhost: x\r\n\r\nGET /g HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    assert head.startswith(b"HTTP/1.1 200 ") and b"content-length: " in head
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/g"
    writer.close()


async def test_expect_100_continue_then_answer(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(b"POST /up HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                 b"content-length: 5\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "hello"
    writer.close()


async def test_content_length_over_limit_is_413_and_closed(serve: Started) -> None:
    called = []

    async def handler(request: Request) -> Response:
        called.append(request.path)
        return json_response({})

    _, port = await serve(handler, max_body=100, limit_hint=" (raise --max-body)")
    reader, writer = await connect(port)
    # Expect: 100-continue must not be acknowledged for a body we refuse.
    writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                 b"content-length: 101\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 413
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert "100 bytes" in error and "--max-body" in error
    assert await at_eof(reader)
    assert called == []

    # Exactly at the limit is fine.
    reader, writer = await connect(port)
    writer.write(b"POST /ok HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"y" * 100)
    assert (await read_response(reader))[0] == 200
    assert called == ["/ok"]
    writer.close()


async def test_a_refused_body_still_sending_gets_its_answer(serve: Started) -> None:
    """The client keeps sending the body after the 413: the server drains it while it
    lingers, so no reset destroys the answer before the client reads it."""
    _, port = await serve(echo, max_body=1000)
    for _ in range(10):
        reader, writer = await connect(port)
        writer.write(b"POST /big HTTP/1.1\r\nhost: x\r\ncontent-length: 4000000\r\n\r\n")
        for _ in range(8):
            writer.write(b"z" * 100_000)
            await asyncio.sleep(0)
        status, _, body = await read_response(reader)
        assert status == 413 and "1000 bytes" in json.loads(body)["error"]
        writer.close()


async def test_a_refusal_while_reading_is_paused_still_drains(serve: Started) -> None:
    """A malformed request behind more pipelined ones than are read ahead: the 400 comes
    while reading is paused, and the lingering close must read (and drop) what the client
    still sends, not leave it unread until a reset."""
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        await release.wait()
        return json_response({})

    server, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
                 + b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n" * 65 + b"NOT HTTP\r\n\r\n")
    status, _, _ = await read_response(reader, timeout=30)
    assert status == 400
    # More than the kernel's buffers hold: only a server that reads lets this drain end.
    writer.write(b"z" * (32 << 20))
    await asyncio.wait_for(writer.drain(), 30)
    release.set()
    writer.close()


async def test_chunked_body_over_limit_is_413(serve: Started) -> None:
    called = []

    async def handler(request: Request) -> Response:
        called.append(request.body)
        return json_response({})

    _, port = await serve(handler, max_body=100)
    reader, writer = await connect(port)
    writer.write(b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"3c\r\n" + b"a" * 60 + b"\r\n")
    writer.write(b"3c\r\n" + b"b" * 60 + b"\r\n0\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 413 and "100 bytes" in json.loads(body)["error"]
    assert await at_eof(reader)
    assert called == []

    # A chunked body under the limit arrives de-chunked.
    reader, writer = await connect(port)
    writer.write(b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    assert called == [b"abcde"]
    writer.close()


@pytest.mark.parametrize("raw", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9x\r\nhost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nbad header line\r\n\r\n",
    b"GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
])
async def test_malformed_request_is_400_json_and_closed(serve: Started, raw: bytes) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(raw)
    status, headers, body = await read_response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]
    assert await at_eof(reader)


async def test_oversized_headers_are_431(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    many = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 1000) for i in range(MAX_HEADER_BYTES // 1000 + 2))
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n" + many + b"\r\n")
    status, _, body = await read_response(reader)
    assert status == 431 and "request headers over" in json.loads(body)["error"]
    assert await at_eof(reader)

    # Headers just under the limit are served.
    reader, writer = await connect(port)
    some = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 1000) for i in range(MAX_HEADER_BYTES // 1100))
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n" + some + b"\r\n")
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_endless_header_line_is_431(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (2 * MAX_HEADER_BYTES))
    try:
        status, _, _ = await read_response(reader, timeout=0.5)
    except TimeoutError:
        pytest.fail("no answer to an endless header line")
    assert status == 431
    writer.close()


async def test_handler_error_is_500_json_and_connection_stays_usable(
        serve: Started, caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("handler exploded")
        return json_response({"path": request.path})

    _, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 500 and "internal" in json.loads(body)["error"]
    assert "handler exploded" not in body.decode()  # no internals leak to the client
    assert any("handler exploded" in (r.exc_text or "") for r in caplog.records)
    writer.write(b"GET /after HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/after"
    writer.close()


async def test_handler_connection_reset_from_elsewhere_still_answers(serve: Started) -> None:
    async def handler(request: Request) -> Response:
        raise ConnectionResetError("some other socket was reset")

    _, port = await serve(handler)
    reader, writer = await connect(port)
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        status, _, _ = await read_response(reader, timeout=0.5)
    except TimeoutError:
        pytest.fail("no answer and no close for a live client")
    assert status == 500
    writer.close()


async def test_http10_without_keep_alive_is_closed_after_answer(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(b"GET /old HTTP/1.0\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/old"
    assert headers["connection"] == "close"
    assert await at_eof(reader)


async def test_connection_close_is_honoured(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(b"GET /first HTTP/1.1\r\nhost: x\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.write(b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    status, headers, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/last"
    assert headers["connection"] == "close"
    assert await at_eof(reader)

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/x",
                               headers={"Connection": "close"}) as resp:
            assert resp.status == 200 and resp.headers["connection"] == "close"


async def test_request_pipelined_after_connection_close_is_ignored(serve: Started) -> None:
    _, port = await serve(echo)
    reader, writer = await connect(port)
    writer.write(b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
                 b"GET /never HTTP/1.1\r\nhost: x\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["path"] == "/last"
    assert await at_eof(reader)


async def test_query_parsing(serve: Started) -> None:
    async def handler(request: Request) -> Response:
        return json_response({"path": request.path, "qs": request.query_string,
                              "query": request.query})

    _, port = await serve(handler)
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/x?a=1&b=&c=x%20y&a=2"
        async with session.get(url) as resp:
            got = await resp.json()
        assert got["path"] == "/v1/x"
        assert got["qs"] == "a=1&b=&c=x%20y&a=2"
        assert got["query"] == {"a": "2", "b": "", "c": "x y"}
        async with session.get(f"http://127.0.0.1:{port}/plain") as resp:
            got = await resp.json()
        assert got == {"path": "/plain", "qs": "", "query": {}}


async def test_request_headers_are_lower_case_and_response_headers_sent(
        serve: Started) -> None:
    async def handler(request: Request) -> Response:
        return Response(201, request.headers["x-mixed-case"].encode(), "text/plain",
                        {"x-answer": "42"})

    _, port = await serve(handler)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/",
                               headers={"X-Mixed-Case": "Value"}) as resp:
            assert resp.status == 201
            assert resp.headers["content-type"] == "text/plain"
            assert resp.headers["x-answer"] == "42"
            assert await resp.read() == b"Value"
