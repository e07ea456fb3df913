"""Prometheus metrics of one router app (its own registry, so tests can run many apps)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from router.breaker import STATE_CODES

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                   60, 300)
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvatlas_router_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.decisions = Counter("kvatlas_router_routing_decisions",
                                 "Requests routed to each instance", ["role", "instance"],
                                 registry=r)
        self.prefix_hit_tokens = Counter("kvatlas_router_prefix_hit_tokens",
                                         "Prompt tokens the chosen prefill already held "
                                         "(index or prediction)", registry=r)
        self.prompt_tokens = Counter("kvatlas_router_prompt_tokens", "Prompt tokens routed",
                                     registry=r)
        self.retries = Counter("kvatlas_router_retries", "Attempts after the first", ["route"],
                               registry=r)
        self.upstream_errors = Counter("kvatlas_router_upstream_errors",
                                       "Failed upstream attempts", ["role", "reason"], registry=r)
        self.breaker_state = Gauge("kvatlas_router_breaker_state",
                                   "Circuit state per worker (0 closed, 1 half-open, 2 open)",
                                   ["role", "instance"], registry=r)
        self.workers = Gauge("kvatlas_router_workers", "Workers per role and availability",
                             ["role", "available"], registry=r)
        self.upstream_latency = Histogram("kvatlas_router_upstream_latency_seconds",
                                          "Upstream request latency (to the full answer or the "
                                          "end of the stream)", ["role"],
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.decision_latency = Histogram("kvatlas_router_decision_seconds",
                                          "Time to pick a prefill/decode pair",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.index_ready = Gauge("kvatlas_router_index_ready",
                                 "1 when the block index mirror is loaded", registry=r)
        self.index_stale = Gauge("kvatlas_router_index_stale",
                                 "1 when routing on the last known index (etcd unreachable)",
                                 registry=r)
        self.index_blocks = Gauge("kvatlas_router_index_blocks", "Blocks in the mirror",
                                  registry=r)
        self.index_revision_lag = Gauge("kvatlas_router_index_revision_lag",
                                        "Revisions between etcd's head and the mirror",
                                        registry=r)
        self.predicted_blocks = Gauge("kvatlas_router_predicted_blocks",
                                      "Router-side predicted (instance, block) entries",
                                      registry=r)

        # Label lookups cost microseconds each; the hot path reuses the children.
        self._children: dict[tuple[Any, ...], Any] = {}
        self.latency = {role: self.upstream_latency.labels(role) for role in ("prefill", "decode")}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def forget(self, role: str, instance: str) -> None:
        """Drop a departed worker's series so label sets stay bounded."""
        for metric in (self.decisions, self.breaker_state):
            self._children.pop((id(metric), role, instance), None)
            try:
                metric.remove(role, instance)
            except KeyError:
                pass

    def set_breakers(self, workers: list) -> None:
        self.breaker_state.clear()
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            self.breaker_state.labels(w.role, w.instance_id).set(STATE_CODES[w.breaker.state])
            key = (w.role, "true" if w.available else "false")
            counts[key] = counts.get(key, 0) + 1
        self.workers.clear()
        for (role, avail), n in counts.items():
            self.workers.labels(role, avail).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
