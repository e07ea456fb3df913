"""Waiting in tests for a state, not for a time.

A test that sleeps "long enough" for something to happen is slow when the machine is idle and
flaky when it is loaded. ``wait_until`` (async) and ``wait_until_sync`` poll a predicate until it
holds, under a deadline that is only a safety net (generous by default: a loaded CI machine is
not a failure), and on timeout raise an AssertionError naming what never happened, with the
state at that moment (``detail``) so the failure explains itself.

Sleeps that are the thing tested (a client that must be slow, a duration that must pass while
something does NOT happen) are not waits for a state and stay plain sleeps, with a comment.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

TIMEOUT_S = 30.0
"""Default deadline: a safety net against hanging, not a speed requirement."""


def _failure(what: str, timeout: float, detail: Callable[[], object] | None) -> AssertionError:
    message = f"timed out after {timeout:g} s waiting until {what}"
    if detail is not None:
        message += f": {detail()!r}"
    return AssertionError(message)


async def wait_until(predicate: Callable[[], T | Awaitable[T]], *, what: str,
                     timeout: float = TIMEOUT_S, interval: float = 0.02,
                     detail: Callable[[], object] | None = None) -> T:
    """Poll ``predicate`` (sync or async) every ``interval`` seconds until it returns a truthy
    value, and return that value. Past ``timeout`` raise AssertionError saying that ``what``
    (phrased as the state awaited: "the mirror holds 3 blocks") never happened, followed by
    ``detail()`` when given."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise _failure(what, timeout, detail)
        await asyncio.sleep(interval)


def wait_until_sync(predicate: Callable[[], T], *, what: str, timeout: float = TIMEOUT_S,
                    interval: float = 0.05, detail: Callable[[], object] | None = None) -> T:
    """``wait_until`` for code without an event loop (tests of subprocesses, threads)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(what, timeout, detail)
        time.sleep(interval)
