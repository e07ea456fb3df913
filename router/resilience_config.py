"""The router's settings for talking to workers (health checks, circuit breakers, retries,
upstream timeouts and connections), each next to its ``kvatlas router serve`` flag (sglang-router's
names). ``RouterConfig`` takes these fields as its own."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass
class ResilienceSettings:
    """How failing workers are detected, avoided and retried."""

    health_interval: float = 5.0
    """Seconds between health checks of each worker."""
    health_check_enabled: bool = True
    """False: no health checks; workers count as healthy while registered."""
    health_timeout: float = 5.0
    """Seconds a health check may take."""
    health_failure_threshold: int = 3
    """Consecutive failed checks that mark a worker unhealthy."""
    health_success_threshold: int = 2
    """Consecutive passed checks that mark it healthy again."""
    breaker_failure_threshold: int = 10
    """Consecutive failures that open a worker's circuit."""
    breaker_success_threshold: int = 3
    """Successes in half-open that close it."""
    breaker_timeout: float = 60.0
    """Seconds an open circuit waits before going half-open."""
    breaker_enabled: bool = True
    """False: circuits never open (a failed attempt is still retried on another pair)."""
    retry_max_attempts: int = 5
    """Attempts in all (1: no retries)."""
    retry_initial_backoff: float = 0.05
    """Seconds before the second attempt."""
    retry_backoff_multiplier: float = 1.5
    """Backoff growth per attempt."""
    retry_max_backoff: float = 30.0
    """Cap on one backoff."""
    retry_jitter: float = 0.2
    """Relative jitter (±) on each backoff."""
    request_timeout: float = 1800.0
    """Seconds an upstream may stay silent (between bytes) before the attempt fails."""
    connect_timeout: float = 10.0
    """Seconds to connect to an upstream."""
    max_connections: int = 2048
    """Upstream connection pool size."""

    def __post_init__(self) -> None:
        for name in ("health_failure_threshold", "health_success_threshold",
                     "breaker_failure_threshold", "breaker_success_threshold",
                     "retry_max_attempts", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval", "health_timeout", "request_timeout", "connect_timeout",
                     "retry_backoff_multiplier"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("breaker_timeout", "retry_initial_backoff", "retry_max_backoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.retry_jitter < 1:
            raise ValueError(f"retry_jitter must be within [0, 1), got {self.retry_jitter}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (no jitter)."""
        return min(self.retry_max_backoff,
                   self.retry_initial_backoff * self.retry_backoff_multiplier ** attempt)


def add_resilience_args(parser: argparse.ArgumentParser) -> None:
    """Health-check, circuit-breaker, retry and upstream-timeout flags."""
    d = ResilienceSettings
    parser.add_argument("--health-check-interval-secs", "--health-interval", type=float,
                        dest="health_interval", default=d.health_interval)
    parser.add_argument("--health-check-timeout-secs", type=float, dest="health_timeout",
                        default=d.health_timeout)
    parser.add_argument("--cb-failure-threshold", type=int,
                        default=d.breaker_failure_threshold)
    parser.add_argument("--cb-success-threshold", type=int,
                        default=d.breaker_success_threshold)
    parser.add_argument("--cb-timeout-duration-secs", type=float, default=d.breaker_timeout)
    parser.add_argument("--disable-circuit-breaker", action="store_true",
                        help="circuits never open")
    parser.add_argument("--disable-health-check", action="store_true",
                        help="no health checks: registered workers count as healthy")
    parser.add_argument("--retry-max-retries", type=int, default=d.retry_max_attempts,
                        help="attempts in all (default 5)")
    parser.add_argument("--retry-initial-backoff-ms", type=float,
                        default=d.retry_initial_backoff * 1000)
    parser.add_argument("--retry-max-backoff-ms", type=float,
                        default=d.retry_max_backoff * 1000)
    parser.add_argument("--retry-backoff-multiplier", type=float,
                        default=d.retry_backoff_multiplier)
    parser.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter)
    parser.add_argument("--disable-retries", action="store_true",
                        help="one attempt per request (as --retry-max-retries 1)")
    parser.add_argument("--health-failure-threshold", type=int,
                        default=d.health_failure_threshold)
    parser.add_argument("--health-success-threshold", type=int,
                        default=d.health_success_threshold)
    parser.add_argument("--request-timeout-secs", type=float, default=d.request_timeout)


def resilience_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``ResilienceSettings`` keyword arguments of the flags registered above."""
    return dict(
        health_interval=args.health_interval, health_timeout=args.health_timeout,
        breaker_failure_threshold=args.cb_failure_threshold,
        breaker_success_threshold=args.cb_success_threshold,
        breaker_timeout=args.cb_timeout_duration_secs,
        breaker_enabled=not args.disable_circuit_breaker,
        health_check_enabled=not args.disable_health_check,
        retry_max_attempts=1 if args.disable_retries else args.retry_max_retries,
        retry_initial_backoff=args.retry_initial_backoff_ms / 1000,
        retry_max_backoff=args.retry_max_backoff_ms / 1000,
        retry_backoff_multiplier=args.retry_backoff_multiplier,
        retry_jitter=args.retry_jitter_factor,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        request_timeout=args.request_timeout_secs)
