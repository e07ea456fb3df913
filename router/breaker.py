"""Per-worker circuit breaker (sglang-router's defaults: 10 failures open, 60 s, 3 successes)."""
from __future__ import annotations

import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}


class CircuitBreaker:
    """closed -(N consecutive failures)-> open -(timeout)-> half_open -(M successes)-> closed;
    any failure in half_open reopens it. 4xx responses are the caller's to count as success."""

    def __init__(self, failure_threshold: int = 10, success_threshold: int = 3,
                 timeout: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 enabled: bool = True) -> None:
        self.enabled = enabled
        """False: never opens (sglang-router's --disable-circuit-breaker)."""
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.timeout = timeout
        self._clock = clock
        self._state = CLOSED
        self.failures = 0
        self.successes = 0
        self.opened_at = 0.0
        self.total_opens = 0

    @property
    def state(self) -> str:
        """The current state; an open circuit whose timeout passed reads as half_open."""
        if self._state == OPEN and self._clock() - self.opened_at >= self.timeout:
            self._state = HALF_OPEN
            self.successes = 0
        return self._state

    def allow(self) -> bool:
        """May a request go to this worker now?"""
        return self.state != OPEN

    def record_success(self) -> None:
        state = self.state
        self.failures = 0
        if state == HALF_OPEN:
            self.successes += 1
            if self.successes >= self.success_threshold:
                self._state = CLOSED
                self.successes = 0

    def record_failure(self) -> None:
        if not self.enabled:
            return
        state = self.state
        if state == HALF_OPEN:
            self._open()
            return
        self.failures += 1
        if state == CLOSED and self.failures >= self.failure_threshold:
            self._open()

    def _open(self) -> None:
        self._state = OPEN
        self.opened_at = self._clock()
        self.successes = 0
        self.failures = 0
        self.total_opens += 1
