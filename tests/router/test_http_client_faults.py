"""The router's upstream HTTP/1.1 client (router/http/client.py) under faults: retries of
reused connections, answers cut short or malformed, connect and read timeouts, cancellation,
connections dropped by either side, and pool.close.

The worker side is a raw asyncio server scripted byte by byte (http_helpers.Worker)."""
from __future__ import annotations

import asyncio
import socket
import time

import http_helpers
import pytest
from http_helpers import Reader, Worker, Writer, answer, hang_or_ok, keep_alive
from http_helpers import WorkerStarted as Started

from kvatlas.etcd_proc import free_port
from router.http.client import UpstreamClosed, UpstreamConnectError, UpstreamError, UpstreamTimeout

worker = http_helpers.worker  # the fixtures
pools = http_helpers.pools


async def test_worker_closing_pooled_connection_is_retried_once(worker: Started, pools) -> None:
    answered: list[tuple[int, str]] = []

    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        # Connection 1 answers one request, then takes the next and drops it unanswered, as a
        # worker closing an idle connection just as the router reuses it.
        while await w.read_request(n, reader):
            if n == 1 and len(answered) == 1:
                return
            answered.append((n, w.requests[-1][1]))
            writer.write(answer(b"ok%d" % n))
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/first", {}, b""), 2)).release()
    resp = await asyncio.wait_for(pool.call("POST", "/second", {}, b"body"), 2)
    assert resp.take() == b"ok2"
    resp.release()
    assert w.connections == 2
    assert answered == [(1, "GET /first HTTP/1.1"), (2, "POST /second HTTP/1.1")]
    assert w.requests[-1][3] == b"body"  # the same request went out again, body and all


async def test_retry_happens_only_once(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        # Only the very first request is ever answered; later ones are read and dropped.
        while await w.read_request(n, reader):
            if len(w.requests) > 1:
                return
            writer.write(answer(b"ok"))
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/first", {}, b""), 2)).release()
    with pytest.raises(UpstreamClosed) as err:
        await asyncio.wait_for(pool.call("GET", "/second", {}, b""), 2)
    assert err.value.origin == w.url
    assert w.connections == 2 and len(w.requests) == 3


async def test_idle_connection_closed_by_worker_is_not_used(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(answer(b"once"))  # keep-alive answer, then the worker closes anyway
        await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)).release()
    await asyncio.wait_for(w.closed[0].wait(), 2)
    await asyncio.sleep(0.05)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    assert resp.take() == b"once"
    assert w.connections == 2 and len(w.requests) == 2


async def test_connection_closed_mid_answer(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()
        await asyncio.sleep(0.05)

    w = await worker(script)
    pool = pools(w.url)
    with pytest.raises(UpstreamClosed):
        await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)

    # Streamed: the bytes that came are read, then the cut is an error, not a clean end.
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b"", stream=True), 2)
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b"abc"
    with pytest.raises(UpstreamClosed):
        await asyncio.wait_for(resp.read_chunk(), 2)
    resp.release()
    assert w.connections == 2


async def test_reused_connection_closed_mid_answer_is_not_retried(worker: Started,
                                                                  pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(answer(b"ok"))
        await writer.drain()
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nab")

    w = await worker(script)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)).release()
    with pytest.raises(UpstreamClosed):
        await asyncio.wait_for(pool.call("POST", "/", {}, b"x"), 2)
    assert w.connections == 1 and len(w.requests) == 2


async def test_malformed_answer_is_upstream_closed(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"SSH-2.0-OpenSSH_9.0\r\n\r\n")
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url)
    with pytest.raises(UpstreamClosed, match="malformed HTTP answer"):
        await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    await asyncio.wait_for(w.closed[0].wait(), 2)  # the client dropped the connection


async def test_connect_refused_fails_fast(pools) -> None:
    port = free_port()
    # Fast: the refusal itself ends the call, not the connect timeout, which is set far
    # beyond the wait (a call that waited for it would time out here instead).
    pool = pools(f"http://127.0.0.1:{port}", connect_timeout=120)
    with pytest.raises(UpstreamConnectError, match="cannot connect") as err:
        await asyncio.wait_for(pool.call("GET", "/", {}, b""), 30)
    assert err.value.origin == f"http://127.0.0.1:{port}"


async def test_connect_timeout(pools) -> None:
    # A listener whose accept queue is full drops further SYNs, so connect just hangs.
    listener = socket.socket()
    fillers: list[socket.socket] = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
        await asyncio.sleep(0.05)
        pool = pools(f"http://127.0.0.1:{port}", connect_timeout=0.2)
        t0 = time.monotonic()
        # The pool's own timer fires (its message names it), however loaded the box: the
        # outer wait is only a generous bound. Not early: a load can only make it later.
        with pytest.raises(UpstreamConnectError, match="connect timed out after 0.2 s"):
            await asyncio.wait_for(pool.call("GET", "/", {}, b""), 30)
        assert time.monotonic() - t0 >= 0.15
    finally:
        for s in fillers:
            s.close()
        listener.close()


async def test_read_timeout(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        await w.wait_eof(reader, timeout=5)  # never answers

    w = await worker(script)
    pool = pools(w.url, read_timeout=0.2)
    t0 = time.monotonic()
    # As for the connect timeout: the read timer fires (named in the message), not early.
    with pytest.raises(UpstreamTimeout, match="no data for 0.2 s"):
        await asyncio.wait_for(pool.call("GET", "/", {}, b""), 30)
    assert time.monotonic() - t0 >= 0.15
    await asyncio.wait_for(w.closed[0].wait(), 2)  # the silent connection was dropped
    assert not pool.idle


async def test_read_timeout_counts_silence_not_total_time(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        # 0.72 s in all (over the 0.6 s timeout), 0.06 s apart: a stalled loop or a loaded
        # box may stretch a gap tenfold before it looks like silence.
        for _ in range(12):
            await asyncio.sleep(0.06)
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url, read_timeout=0.6)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 30)
    assert resp.take() == b"x" * 12

    # Streamed: the same timeout applies between chunks.
    w2 = await worker(script)
    pool2 = pools(w2.url, read_timeout=0.6)
    resp = await asyncio.wait_for(pool2.call("GET", "/", {}, b"", stream=True), 30)
    assert await asyncio.wait_for(resp.read(), 30) == b"x" * 12


async def test_stream_timeout_mid_body(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await w.wait_eof(reader, timeout=5)

    w = await worker(script)
    pool = pools(w.url, read_timeout=0.2)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b"", stream=True), 2)
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b"abc"
    with pytest.raises(UpstreamTimeout):
        await asyncio.wait_for(resp.read_chunk(), 2)
    resp.release()


async def test_cancelling_a_call_drops_its_connection(worker: Started, pools) -> None:
    w = await worker(hang_or_ok)
    pool = pools(w.url)
    # On a fresh connection.
    fut = pool.call("GET", "/hang1", {}, b"")
    await asyncio.wait_for(w.got_request.wait(), 2)
    fut.cancel()
    await asyncio.wait_for(w.closed[0].wait(), 2)
    # On a pooled one.
    (await asyncio.wait_for(pool.call("GET", "/ok", {}, b""), 2)).release()
    assert w.connections == 2
    w.got_request.clear()
    fut = pool.call("GET", "/hang2", {}, b"")
    await asyncio.wait_for(w.got_request.wait(), 2)
    fut.cancel()
    await asyncio.wait_for(w.closed[1].wait(), 2)
    assert not pool.idle and not pool.active
    (await asyncio.wait_for(pool.call("GET", "/ok", {}, b""), 2)).release()
    assert w.connections == 3


async def test_cancelling_a_call_while_connecting(worker: Started, pools) -> None:
    w = await worker(keep_alive)
    pool = pools(w.url)
    fut = pool.call("GET", "/never", {}, b"")
    await asyncio.sleep(0)  # the connect has begun
    fut.cancel()
    (await asyncio.wait_for(pool.call("GET", "/ok", {}, b""), 2)).release()
    # The worker has answered the next call by now: the cancelled one never reached it.
    assert [r[1] for r in w.requests] == ["GET /ok HTTP/1.1"]
    assert len(pool.idle) <= 1


async def test_connection_close_answer_is_not_reused(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        while await w.read_request(n, reader):
            # Says close but leaves the socket open: the client must drop it itself.
            writer.write(answer(b"bye", extra=b"connection: close\r\n"))
            await writer.drain()

    w = await worker(script)
    pool = pools(w.url)
    for _ in range(2):
        resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
        assert resp.take() == b"bye"
        resp.release()
    assert w.connections == 2
    await asyncio.wait_for(w.closed[0].wait(), 2)
    assert not pool.idle


async def test_release_of_unfinished_stream_closes_connection(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        while await w.read_request(n, reader):
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
            await writer.drain()
            if n == 1:
                await w.wait_eof(reader, timeout=5)
                return
            writer.write(b"0\r\n\r\n")

    w = await worker(script)
    pool = pools(w.url)
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b"", stream=True), 2)
    assert await asyncio.wait_for(resp.read_chunk(), 2) == b"abc"
    resp.release()
    await asyncio.wait_for(w.closed[0].wait(), 2)
    with pytest.raises(RuntimeError):
        await resp.read_chunk()
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b"", stream=True), 2)
    assert await asyncio.wait_for(resp.read(), 2) == b"abc"
    resp.release()
    assert w.connections == 2

    # close() drops even a complete answer's connection.
    resp = await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)
    resp.close()
    resp.close()
    await asyncio.wait_for(w.closed[1].wait(), 2)
    assert not pool.idle


async def test_idle_connection_that_talks_is_dropped(worker: Started, pools) -> None:
    async def script(w: Worker, n: int, reader: Reader, writer: Writer) -> None:
        await w.read_request(n, reader)
        writer.write(answer(b"ok"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\n")  # unasked-for bytes on an idle connection
        await w.wait_eof(reader)

    w = await worker(script)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/", {}, b""), 2)).release()
    assert len(pool.idle) == 1
    await asyncio.wait_for(w.closed[0].wait(), 2)
    assert not pool.idle


async def test_pool_close_fails_in_flight_calls(worker: Started, pools) -> None:
    w = await worker(hang_or_ok)
    pool = pools(w.url)
    (await asyncio.wait_for(pool.call("GET", "/warm", {}, b""), 2)).release()
    reused = pool.call("GET", "/hang-reused", {}, b"")
    fresh = pool.call("GET", "/hang-fresh", {}, b"")
    while len(w.requests) < 3:
        await asyncio.sleep(0.01)
    pool.close()
    for fut in (reused, fresh):
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(fut, 2)
    for closed in w.closed:
        await asyncio.wait_for(closed.wait(), 2)
    with pytest.raises(UpstreamClosed, match="shutting down"):
        await pool.call("GET", "/late", {}, b"")
    assert len(w.requests) == 3  # nothing was re-sent after the close


async def test_pool_close_during_connect(worker: Started, pools) -> None:
    w = await worker(keep_alive)
    pool = pools(w.url)
    fut = pool.call("GET", "/late", {}, b"")
    await asyncio.sleep(0)  # the connect has begun
    pool.close()
    with pytest.raises(UpstreamError):
        resp = await asyncio.wait_for(fut, 2)
        resp.release()
    await asyncio.sleep(0.05)
    assert w.requests == []
