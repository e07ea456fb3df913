"""The router bench's load and process helpers, shared by its SGLang parts (bench/router.py)
and its vLLM-PD part (bench/_vllm_pd.py): stub servers, a closed-loop client, starting and
stopping routers, and the CPU a process spent."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

PROMPT = ("You are a helpful assistant. Answer the question using the context. " * 12)
"""The system prompt of the bench's bodies (and, alone, the default /generate body's text)."""


def serve_apps(apps: list[tuple[int, Any]]) -> None:
    """Serve each (port, aiohttp app) on loopback, say ``ready`` on stdout, run until
    interrupted (the stub processes of bench/router.py's parts)."""
    async def main() -> None:
        runners = []
        for port, app in apps:
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        print("ready", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


async def post_until_ok(url: str, body: bytes, path: str = "/v1/completions",
                        timeout: float = 60.0) -> bool:
    """Whether ``url`` answers ``body`` posted to ``path`` with 200 within ``timeout``."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(f"{url}{path}", data=body,
                                        headers={"content-type": "application/json"}) as resp:
                    if resp.status == 200:
                        return True
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    return False


async def closed_loop(url: str, concurrency: int, duration: float,
                      bodies: list[bytes] | None = None) -> dict[str, Any]:
    lat: list[float] = []
    errors = 0
    bodies = bodies or [json.dumps({"text": PROMPT,
                                    "sampling_params": {"max_new_tokens": 1}}).encode()]
    sent = 0

    def next_body() -> bytes:
        nonlocal sent
        sent += 1
        return bodies[sent % len(bodies)]
    headers = {"content-type": "application/json"}
    stop_at = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one_worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with session.post(url, data=next_body(), headers=headers) as resp:
                        await resp.read()
                        if resp.status != 200:
                            errors += 1
                            continue
                except aiohttp.ClientError:
                    errors += 1
                    continue
                lat.append(time.perf_counter() - t0)

        # Warm-up: connections and any lazy init.
        for _ in range(20):
            async with session.post(url, data=next_body(), headers=headers) as resp:
                await resp.read()
        t0 = time.perf_counter()
        await asyncio.gather(*(one_worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    lat.sort()
    n = len(lat)
    return {"requests": n, "errors": errors, "rps": n / elapsed,
            "p50_ms": 1000 * lat[n // 2] if n else None,
            "p99_ms": 1000 * lat[min(n - 1, n * 99 // 100)] if n else None}


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
