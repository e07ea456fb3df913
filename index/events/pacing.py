"""Cooperative pacing of event ingestion on a shared asyncio loop.

Awaiting a ZMQ receive (or an ``asyncio.Queue.get``) that has a message ready returns without
ever giving the loop a turn, and so does an ingestor whose index writes never wait. A burst of
queued events would then hold the loop for as long as it takes to apply them all, and every
other task of the process waits: the lease keepalive (the instance's keys expire after the TTL),
the health probe, the bootstrap poller. A ``TimeSlice`` hands the loop back once ``budget``
seconds of work ran without a pause, so any other task waits at most about one budget per turn,
however much work is queued.
"""
from __future__ import annotations

import asyncio
import time

DEFAULT_BUDGET_S = 0.01
"""10 ms: ingestion keeps most of the loop under a burst, while a keepalive (a few loop turns)
finishes within a fraction of a second."""


class TimeSlice:
    """Call ``await tick()`` after each unit of work; it yields to the loop once ``budget``
    seconds passed since the last yield (a ``time.monotonic`` read otherwise, ~50 ns)."""

    def __init__(self, budget: float = DEFAULT_BUDGET_S) -> None:
        if not 0 < budget <= 1.0:
            raise ValueError(f"time slice budget must be within (0, 1] s, got {budget}")
        self.budget = budget
        self.yields = 0
        """Times the loop was handed back (a busy ingestion shows many)."""
        self._since = time.monotonic()

    async def tick(self) -> None:
        if time.monotonic() - self._since >= self.budget:
            await asyncio.sleep(0)
            self.yields += 1
            self._since = time.monotonic()
