"""Slow clients (slowloris) on the aiohttp servers: a request head, or a body, trickled a byte at a
time is cut off after the read timeout, on the bootstrap server as on the engine's port, both
served the way kvatlas serves them (``bootstrap.http_limits``); a prompt client is served."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import aiohttp
import pytest
from aiohttp import web
from waiting import wait_until

from bootstrap.config import BootstrapConfig
from bootstrap.http_limits import make_runner
from bootstrap.server import create_app as create_bootstrap_app
from engine.serve_config import EngineServerConfig
from engine.server import create_app as create_engine_app
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
READ_TIMEOUT = 1.0
CAP = 30.0  # far past READ_TIMEOUT: only a server that never cuts the client reaches it
SLOW_BODY = 10_000  # bytes announced: dripped at 5 a second, never complete before the 408


async def trickle(port: int, head: bytes, drip: bytes, period: float = 0.2) -> bytes:
    """Send ``head``, then ``drip`` every ``period`` s until the server answers or hangs up;
    returns its answer (head and body; b"": it closed without one). Raises AssertionError when
    the server still listens after CAP seconds."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    deadline = loop.time() + CAP
    try:
        writer.write(head)
        while loop.time() < deadline:
            try:
                first = await asyncio.wait_for(reader.read(1), period)
            except TimeoutError:
                try:
                    writer.write(drip)
                    await writer.drain()
                except ConnectionError:
                    return b""
                continue
            except ConnectionError:
                return b""
            if not first:
                return b""
            answer = first + await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in answer.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            return answer + await reader.readexactly(length)
        raise AssertionError(f"the server kept a slow client for {CAP} s")
    finally:
        writer.close()


class Cut(NamedTuple):
    """What a server did with slow clients."""
    slow_head_answer: bytes  # to a head trickled a byte at a time (b"": it hung up, no answer)
    slow_body_status: int  # to a body trickled a byte at a time
    slow_body_error: str  # the JSON error of that answer
    health_after: int  # a prompt client's GET /health afterwards


# The read timeout cuts both slow clients, the slow body with a JSON reason, and the server
# still serves a prompt client.
CUT = Cut(b"", 408, f"request body not received within {READ_TIMEOUT:g} s "
                    "(the server's read timeout)", 200)


async def slow_clients(port: int, body_path: str, method: str = "POST") -> Cut:
    """Trickle a head, then a body, to the server at ``port``; then ask it for /health."""
    head_answer = await trickle(port, b"GET /health HTTP/1.1\r\nHost: a\r\n", b"X-Slow: 1\r\n")
    answer = await trickle(port, f"{method} {body_path} HTTP/1.1\r\nHost: a\r\nContent-Type: "
                                 "application/json\r\nContent-Length: 100\r\n\r\n{".encode(), b" ")
    status, _, rest = answer.partition(b"\r\n")
    doc = json.loads(rest.partition(b"\r\n\r\n")[2] or b"{}")
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/health") as r:
        health = r.status
    return Cut(head_answer, int(status.split()[1]) if status else 0, doc.get("error", ""),
               health)


async def after_408(port: int, body_path: str, method: str = "POST") -> bytes:
    """Trickle a body until the server answers 408; then send the rest of the body and a
    pipelined ``GET /health``. Returns what the server sent after the 408, until it closed."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {body_path} HTTP/1.1\r\nHost: a\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {SLOW_BODY}\r\n\r\n{{".encode())
        sent, got, deadline = 1, b"", loop.time() + CAP
        while b"\r\n\r\n" not in got:
            assert loop.time() < deadline, f"no answer to a slow body within {CAP} s"
            try:
                got += await asyncio.wait_for(reader.read(4096), 0.2)
            except TimeoutError:
                writer.write(b" ")
                sent += 1
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        rest = rest + await reader.readexactly(length - len(rest))
        writer.write(b" " * (SLOW_BODY - sent) + b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
        return await asyncio.wait_for(reader.read(), CAP)  # to EOF
    finally:
        writer.close()


async def serve(app: web.Application) -> tuple[int, web.AppRunner]:
    runner = make_runner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return port, runner


@pytest.fixture
async def bootstrap_port() -> AsyncIterator[int]:
    port, runner = await serve(create_bootstrap_app(BootstrapConfig(
        instance_id="slow-1", model="tiny", read_timeout_s=READ_TIMEOUT)))
    yield port
    await runner.cleanup()


async def test_the_bootstrap_server_cuts_slow_clients(bootstrap_port: int) -> None:
    assert await slow_clients(bootstrap_port, "/route", method="PUT") == CUT


async def test_the_engine_port_cuts_slow_clients() -> None:
    port, runner = await serve(create_engine_app(EngineServerConfig(read_timeout_s=READ_TIMEOUT)))
    try:
        assert await slow_clients(port, "/generate") == CUT
    finally:
        await runner.cleanup()


async def test_a_slow_body_is_the_last_request_of_its_connection(bootstrap_port: int) -> None:
    """After its 408 the connection serves nothing more: the body's rest and a request sent
    behind it get no answer (the server closes), on both servers."""
    assert await after_408(bootstrap_port, "/route", method="PUT") == b""
    port, runner = await serve(create_engine_app(EngineServerConfig(read_timeout_s=READ_TIMEOUT)))
    try:
        assert await after_408(port, "/generate") == b""
    finally:
        await runner.cleanup()


async def test_a_prefill_process_cuts_slow_clients_on_both_ports() -> None:
    """`kvatlas engine serve --mode prefill --read-timeout 1`: its engine port and the bootstrap
    server it runs share the bound."""
    port, bport = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVATLAS_LOG_LEVEL": "WARNING"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", "prefill", "--model",
         "tiny", "--host", "127.0.0.1", "--port", str(port), "--bootstrap-port", str(bport),
         "--num-pages", "64", "--read-timeout", str(READ_TIMEOUT)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                assert proc.poll() is None, "the prefill exited"
                try:
                    async with s.get(f"http://127.0.0.1:{bport}/ready") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await wait_until(ready, what="the prefill's bootstrap server answers /ready 200",
                             timeout=90.0, interval=0.2)
        assert await slow_clients(bport, "/route", method="PUT") == CUT
        assert await slow_clients(port, "/generate") == CUT
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
