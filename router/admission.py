"""Admission control: at most N proxied requests at once, a bounded queue for the others.

sglang-router's ``--max-concurrent-requests``, ``--queue-size`` and ``--queue-timeout-secs``:
a router in front of saturated engines should push back rather than pile up requests. A
request past the limit waits in a FIFO queue for a slot; with the queue full it gets a 429
at once, and after waiting too long a 408, both saying which limit it hit, with a one-second
``Retry-After``.
"""
from __future__ import annotations

import asyncio
from collections import deque

from router.errors import Overloaded


class Admission:
    def __init__(self, limit: int, queue_size: int, queue_timeout: float) -> None:
        self.limit = limit
        """Requests served at once; <= 0: no limit (nothing is counted)."""
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        # A waiter leaves the deque as soon as it is handed a slot or gives up.
        return len(self._waiters)

    async def enter(self) -> None:
        """Take a slot, waiting in the queue if need be; Overloaded when there is none."""
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return
        if self.queued >= self.queue_size:
            raise Overloaded(429, f"too many requests: {self.in_flight} in flight (router "
                             f"--max-concurrent-requests {self.limit}) and {self.queued} "
                             f"queued (--queue-size {self.queue_size}); retry later",
                             retry_after=1)
        slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            done, _ = await asyncio.wait({slot}, timeout=self.queue_timeout)
        except asyncio.CancelledError:
            self._give_up(slot)
            raise
        if not done:
            self._give_up(slot)
            raise Overloaded(408, f"no free slot within {self.queue_timeout:g} s (router "
                             f"--queue-timeout-secs; {self.limit} requests at once, "
                             "--max-concurrent-requests)", retry_after=1)

    def leave(self) -> None:
        """Give the slot back: to the longest waiter, if any, else to the pool."""
        if self._waiters:
            self._waiters.popleft().set_result(None)  # handed over: in_flight stays the same
        else:
            self.in_flight -= 1

    def _give_up(self, slot: asyncio.Future[None]) -> None:
        if slot.done():
            # The slot was handed over just as this request stopped waiting: pass it on.
            self.leave()
        else:
            self._waiters.remove(slot)
