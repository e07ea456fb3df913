"""Checks for the start-failure tests (not collected): after a start that failed, nothing it
opened may be left, whatever step failed (``index.lifecycle``)."""
from __future__ import annotations

import asyncio
import socket
import time


class Injected(RuntimeError):
    """The failure a test injects at one start step."""


def raising(what: str):  # type: ignore[no-untyped-def]
    """A stand-in for a step's function (plain or async, bound or not) that fails when called."""
    def fail(*args: object, **kwargs: object) -> object:
        raise Injected(f"injected failure at {what}")
    return fail


async def tasks_left(before: set[asyncio.Task[object]], settle: float = 2.0) -> list[str]:
    """Names of tasks started since ``before`` that are still running. A task that is already
    ending (its cancellation delivered, its last await left) gets ``settle`` seconds."""
    deadline = time.monotonic() + settle
    while True:
        left = [t for t in asyncio.all_tasks() - before
                if not t.done() and t is not asyncio.current_task()]
        if not left or time.monotonic() > deadline:
            return sorted(t.get_name() for t in left)
        await asyncio.sleep(0.05)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on ``port`` (SO_REUSEADDR, as the servers bind: only a
    listening socket, not a connection in TIME_WAIT, makes the bind fail)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
