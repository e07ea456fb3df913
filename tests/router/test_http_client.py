"""The router's upstream HTTP/1.1 client (router/http/client.py) against real loopback servers:
calls, keep-alive reuse, chunked and streamed answers, URLs, pool bounds.

The worker side is a raw asyncio server scripted byte by byte (http_helpers.Worker), so the
tests control exactly what the client sees. Faults (retries, closes, timeouts, cancellation,
pool.close) are in test_http_client_faults.py."""
from __future__ import annotations

import asyncio
import ssl
import time

import http_helpers
import pytest
from http_helpers import Reader, Worker, Writer, answer, keep_alive
from http_helpers import WorkerStarted as Started

from router.http.client import UpstreamPool

worker = http_helpers.worker  # the fixtures
pools = http_helpers.pools


async def test_buffered_call_returns_status_headers_body(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 201 Created\r\ncontent-type: text/plain\r\nX-Mixed: Yes\r\n"
                     b"content-length: 5\r\n\r\nhel")
        await writer.drain()
        await asyncio.sleep(0.02)  # the body in two pieces: the call resolves at the end
        writer.write(b"lo")
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(
        pool.call("POST", "/v1/completions", {"x-request-id": "r1"}, b'{"a": 1}'), 2)
    assert resp.status == 201
    assert resp.headers["x-mixed"] == "Yes"
    assert resp.content_type == "text/plain"
    assert resp.take() == b"hello"
    _, line, headers, body = w.requests[0]
    assert line == "POST /v1/completions HTTP/1.1"
    assert headers["host"] == w.url.removeprefix("http://")
    assert headers["x-request-id"] == "r1" and headers["content-length"] == "8"
    assert body == b'{"a": 1}'
    resp.release()
    with pytest.raises(RuntimeError):
        resp.take()
    resp.release()  # a second release does nothing


async def test_keep_alive_reuses_one_connection(worker: Started, pools) -> None:
    w = await worker(keep_alive)
    pool = pools(w.url)
    for i in range(5):
        resp = await asyncio.wait_for(pool.request("GET", f"/r{i}", {}, b""), 2)
        assert resp.take() == f"GET /r{i} HTTP/1.1".encode()
        resp.release()
    assert w.connections == 1
    assert [r[0] for r in w.requests] == [1] * 5

    # Two calls at once need two connections; both then stay pooled and are reused.
    a, b = pool.call("GET", "/a", {}, b""), pool.call("GET", "/b", {}, b"")
    for resp in await asyncio.wait_for(asyncio.gather(a, b), 2):
        resp.release()
    assert w.connections == 2
    for _ in range(3):
        (await asyncio.wait_for(pool.call("GET", "/c", {}, b""), 2)).release()
    assert w.connections == 2


async def test_chunked_answer_is_dechunked(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        while await w.read_request(n, reader):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b"1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\nx-trailer: t\r\n\r\n")
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    assert resp.take() == b"hello world!"
    resp.release()
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    assert await resp.read() == b"hello world!"  # read() on a buffered answer works too
    resp.release()
    assert w.connections == 1


async def test_stream_read_chunk_in_order_then_empty(worker: Started, pools) -> None:
    go_on = asyncio.Event()

    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        while await w.read_request(n, reader):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            writer.write(b"4\r\none\n\r\n")
            await writer.drain()
            await go_on.wait()
            writer.write(b"4\r\ntwo\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(pool.call("POST", "/s", {}, b"{}", stream=True), 2)
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b"one\n"
    go_on.set()
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b"two\n"
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b""
    assert await resp.read_chunk() == b""
    resp.release()
    # A finished stream gives its connection back to the pool.
    resp = await asyncio.wait_for(pool.call("POST", "/s", {}, b"{}", stream=True), 2)
    assert await asyncio.wait_for(resp.read(), 2) == b"one\ntwo\n"
    resp.release()
    assert w.connections == 1


async def test_answer_delimited_by_close(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    assert resp.take() == b"until the end"


async def test_https_url_gets_an_ssl_context() -> None:
    pool = UpstreamPool("https://worker.example:8443")
    assert isinstance(pool.ssl, ssl.SSLContext)
    assert pool.ssl.verify_mode == ssl.CERT_REQUIRED
    assert (pool.host, pool.port, pool.origin) == ("worker.example", 8443,
                                                    "https://worker.example:8443")
    assert UpstreamPool("https://worker.example").port == 443
    mine = ssl.create_default_context()
    assert UpstreamPool("https://worker.example", ssl=mine).ssl is mine
    plain = UpstreamPool("http://127.0.0.1:8000/ignored/path")
    assert plain.ssl is None and plain.port == 8000 and plain.origin == "http://127.0.0.1:8000"
    assert UpstreamPool("http://worker").port == 80


@pytest.mark.parametrize("url", ["ftp://worker:21", "127.0.0.1:8000", "http://", "worker",
                                 "http:///path"])
async def test_bad_url_is_value_error(url: str) -> None:
    with pytest.raises(ValueError, match="must be http://HOST:PORT"):
        UpstreamPool(url)


async def test_interim_1xx_answer_is_skipped(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n")
        writer.write(answer(b"final", status="200 OK"))
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(pool.call("POST", "/", {}, b"{}"), 2)
    assert (resp.status, resp.take()) == (200, b"final")


async def test_no_content_answer_completes_without_body(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        while await w.read_request(n, reader):
            writer.write(b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n")
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    for _ in range(2):
        resp = await asyncio.wait_for(pool.call("POST", "/", {}, b"{}"), 2)
        assert resp.status == 204 and resp.take() == b""
        resp.release()
    assert w.connections == 1


async def test_slow_stream_reader_pushes_back_on_the_worker(worker: Started, pools) -> None:
    piece = b"z" * (1 << 20)
    total = 48
    sent: list[int] = []

    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * total))
        for i in range(total):
            writer.write(piece)
            await writer.drain()
            sent.append(i)
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url, read_timeout=0.2)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b"", stream=True), 2)
    await asyncio.sleep(0.5)  # not reading, for longer than the read timeout
    # The client stopped reading at its high-water mark: the worker is stuck in drain()
    # with most of the body unsent (socket buffers hold at most a few MiB on loopback).
    assert len(sent) < total // 2, len(sent)
    got = 0
    while chunk := await asyncio.wait_for(resp.read_chunk(), 2):
        got += len(chunk)
    assert got == len(piece) * total and len(sent) == total
    resp.release()


async def test_max_idle_bounds_the_pool(worker: Started, pools) -> None:
    w = await worker(keep_alive)
    pool = pools(w.url, max_idle=1)
    answers = await asyncio.wait_for(asyncio.gather(
        *(pool.call("GET", f"/{i}", {}, b"") for i in range(3))), 2)
    assert w.connections == 3
    for resp in answers:
        resp.release()
    assert len(pool.idle) == 1
    # The two over the limit are closed: the worker sees both ends (the idle one is kept).
    deadline = time.monotonic() + 30
    while sum(c.is_set() for c in w.closed) < 2:
        assert time.monotonic() < deadline, "the connections over the limit stayed open"
        await asyncio.sleep(0.01)
    assert sum(c.is_set() for c in w.closed) == 2
