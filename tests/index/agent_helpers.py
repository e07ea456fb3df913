"""Helpers for the index agent and CLI tests (not collected): loopback endpoints, the real
``python -m kvatlas`` as a subprocess, and publishing until a consumer has seen everything."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import waiting

from index.events.publisher import KVEventPublisher
from index.events.types import KVEvent, KVEventBatch
from kvatlas.etcd_proc import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
async def closers() -> AsyncIterator[list]:
    """Things with an async ``close()`` a test started, closed in reverse order afterwards
    (import the fixture into the test module)."""
    things: list = []
    yield things
    for t in reversed(things):
        await t.close()


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def eventually(cond: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                     what: str = "") -> None:
    """``waiting.wait_until`` with the positional timeout its many callers pass."""
    await waiting.wait_until(cond, what=what or str(cond), timeout=timeout)


async def publish_all(pub: KVEventPublisher, batches: list[list[KVEvent]],
                      seen: Callable[[], int | None | Awaitable[int | None]],
                      timeout: float = 15.0) -> None:
    """Publish ``batches``, then empty heartbeat batches until ``seen()`` (the consumer's last
    sequence number) is the last one published. PUB/SUB drops what precedes the subscription
    (slow joiner); a heartbeat makes the consumer notice such a gap and replay it."""
    for evs in batches:
        pub.drain(list(evs))
        await asyncio.sleep(0.005)

    async def caught_up() -> bool:
        res = seen()
        if not isinstance(res, (int, type(None))):
            res = await res
        if res == pub.next_seq - 1:
            return True
        pub.publish(KVEventBatch(time.time(), []))
        await asyncio.sleep(0.05)
        return False

    await eventually(caught_up, timeout, "the consumer to see every published batch")


async def run_cli(*args: str, timeout: float = 30.0, stdin: bytes | None = None,
                  cwd: Path = REPO) -> tuple[int, str, str]:
    """``python -m kvatlas ARGS`` in a real subprocess: (exit status, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvatlas", *args, cwd=str(cwd), env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(), err.decode()


async def wait_until(cond: Callable[[], object], timeout: float = 10.0,
                     what: str = "condition") -> None:
    """``waiting.wait_until`` with the positional timeout its callers pass."""
    await waiting.wait_until(cond, what=what, timeout=timeout)
