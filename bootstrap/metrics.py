"""Prometheus metrics of one bootstrap server, in a registry of its own (one per app)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

MIRROR_STATES = ("disabled", "connecting", "synced", "degraded")


class BootstrapMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.registrations = Counter(
            "kvatlas_bootstrap_registrations", "PUT /route registrations by outcome "
            "(new, replaced, unchanged, conflict, invalid).", ["outcome"], registry=r)
        self.route_queries = Counter(
            "kvatlas_bootstrap_route_queries", "GET /route queries by kind (topology, rank) "
            "and HTTP status.", ["kind", "status"], registry=r)
        self._route_children: dict[tuple[str, int], Any] = {}
        self.dp_requests = Counter(
            "kvatlas_bootstrap_dp_rank_requests", "register_dp_rank and query_dp_ranks requests "
            "by endpoint and HTTP status.", ["endpoint", "status"], registry=r)
        self.unauthorized = Counter(
            "kvatlas_bootstrap_unauthorized", "PUT/POST requests refused for a missing or wrong "
            "bearer token.", registry=r)
        self.ranks_registered = Gauge(
            "kvatlas_bootstrap_ranks_registered", "Distinct rank cells registered.", registry=r)
        self.ranks_expected = Gauge(
            "kvatlas_bootstrap_ranks_expected", "dp*cp*tp*pp of the registered topology "
            "(0 before the first registration).", registry=r)
        self.ready = Gauge("kvatlas_bootstrap_ready", "1 when every rank cell is registered.",
                           registry=r)
        self.mirror_state = Gauge(
            "kvatlas_bootstrap_mirror_state", "1 for the etcd mirror's current state.", ["state"],
            registry=r)
        self.mirror_lag = Gauge(
            "kvatlas_bootstrap_mirror_lag_seconds", "Age of the oldest table change not yet in "
            "etcd (0 when synced).", registry=r)
        self.mirror_pending = Gauge(
            "kvatlas_bootstrap_mirror_pending_keys", "Keys waiting to be written to etcd.",
            registry=r)
        self.dp_rooms = Gauge("kvatlas_bootstrap_dp_rooms", "Room -> dp rank entries held.",
                              registry=r)
        self.dp_rooms_evicted = Gauge(
            "kvatlas_bootstrap_dp_rooms_evicted", "Room entries evicted by the size bound "
            "before they expired (total).", registry=r)

    def route_query(self, kind: str, status: int) -> None:
        """Count one GET /route answer; the labelled child is cached (this is the hot path)."""
        child = self._route_children.get((kind, status))
        if child is None:
            child = self.route_queries.labels(kind, str(status))
            self._route_children[(kind, status)] = child
        child.inc()

    def bind(self, *, registered: Callable[[], float], expected: Callable[[], float],
             ready: Callable[[], float], mirror_state: Callable[[], str],
             mirror_lag: Callable[[], float], mirror_pending: Callable[[], float],
             dp_rooms: Callable[[], float], dp_rooms_evicted: Callable[[], float]) -> None:
        """Gauges read live state at scrape time instead of being updated on every request."""
        self.ranks_registered.set_function(registered)
        self.ranks_expected.set_function(expected)
        self.ready.set_function(ready)
        for state in MIRROR_STATES:
            self.mirror_state.labels(state).set_function(
                lambda s=state: 1.0 if mirror_state() == s else 0.0)
        self.mirror_lag.set_function(mirror_lag)
        self.mirror_pending.set_function(mirror_pending)
        self.dp_rooms.set_function(dp_rooms)
        self.dp_rooms_evicted.set_function(dp_rooms_evicted)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
