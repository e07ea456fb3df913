"""Prefill work per instance, in blocks: what kv_aware weighs against a prefix hit."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from router.workers import Worker


class WorkLoad:
    """Prefill work (blocks to compute) per instance: in flight, plus recent work decaying."""

    def __init__(self, half_life: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life = half_life
        self._clock = clock
        self._running: dict[str, deque[int]] = {}
        self._sums: dict[str, int] = {}
        """Sum of each ``_running`` queue, kept as it changes (it is read on every decision)."""
        self._recent: dict[str, tuple[float, float]] = {}

    def add(self, instance: str, blocks: int) -> None:
        running = self._running.get(instance)
        if running is None:
            running = self._running[instance] = deque()
        running.append(blocks)
        self._sums[instance] = self._sums.get(instance, 0) + blocks

    def blocks(self, worker: Worker, now: float) -> float:
        """``worker``'s load in blocks; first retires the requests it no longer runs."""
        iid = worker.instance_id
        load = worker.load
        running = self._running.get(iid)
        in_flight = 0
        if running:
            keep = load if load > 0 else 0
            done = 0
            while len(running) > keep:
                done += running.popleft()
            if done:
                self._sums[iid] -= done
                self._recent[iid] = (self._recent_at(iid, now) + done, now)
            if running:
                in_flight = self._sums[iid]
                load -= len(running)
        # Requests the policy did not route (another router path, a retry's stale count).
        if load > 0:
            in_flight += load
        return in_flight + self._recent_at(iid, now)

    def _recent_at(self, instance: str, now: float) -> float:
        value, at = self._recent.get(instance, (0.0, now))
        if not value or self.half_life <= 0:
            return 0.0
        return value * 0.5 ** (max(now - at, 0.0) / self.half_life)

    def forget(self, instance: str) -> None:
        self._running.pop(instance, None)
        self._sums.pop(instance, None)
        self._recent.pop(instance, None)
