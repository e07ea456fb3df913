"""The circuit breaker's state machine, on a controlled clock."""
from __future__ import annotations

from router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(10, 3, 60.0, Clock())
    for _ in range(9):
        b.record_failure()
    b.record_success()  # resets the streak
    for _ in range(9):
        b.record_failure()
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    assert b.state == OPEN and not b.allow()


def test_half_open_after_timeout_then_closes_after_successes() -> None:
    clock = Clock()
    b = CircuitBreaker(2, 3, 60.0, clock)
    b.record_failure()
    b.record_failure()
    assert b.state == OPEN
    clock.t += 59.9
    assert not b.allow()
    clock.t += 0.2
    assert b.state == HALF_OPEN and b.allow()
    b.record_success()
    b.record_success()
    assert b.state == HALF_OPEN
    b.record_success()
    assert b.state == CLOSED and b.total_opens == 1


def test_failure_in_half_open_reopens() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 3, 5.0, clock)
    b.record_failure()
    clock.t += 5
    assert b.state == HALF_OPEN
    b.record_success()
    b.record_failure()
    assert b.state == OPEN and b.total_opens == 2
    clock.t += 4
    assert not b.allow()
    clock.t += 1
    assert b.allow()


def test_a_disabled_breaker_never_opens() -> None:
    b = CircuitBreaker(2, 3, 60.0, Clock(), enabled=False)
    for _ in range(50):
        b.record_failure()
    assert b.state == CLOSED and b.allow()
