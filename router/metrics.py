"""Prometheus metrics of one router app (its own registry, so tests can run many apps).

The per-request counters and histograms are counted in plain Python numbers (``FastCounter``,
``FastHistogram``) and folded into their prometheus children when the registry is collected:
prometheus_client takes a lock per ``inc``/``observe``, about a microsecond each, a dozen times
per routed request. The exposition (names, labels, values, ``_created``) is the prometheus one.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from index.follow import skipped_totals
from index.reader import ShardStatus
from router.breaker import STATE_CODES
from router.engine_load import fresh

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30,
                   60, 300)
REGRET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
SHARD_STATES = {"live": 0, "stale": 1, "loading": 2}
"""``kvatlas_router_index_shard_state``'s values."""
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class FastCounter:
    """A counter child incremented as a plain number, folded into ``target`` at collection."""

    __slots__ = ("target", "value")

    def __init__(self, target: Any) -> None:
        self.target = target
        self.value = 0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def fold(self) -> None:
        if self.value:
            self.target.inc(self.value)
            self.value = 0


class FastHistogram:
    """A histogram child observed into plain bucket counts, folded into ``target`` at
    collection (bucket i counts the values <= bound i and > bound i-1, as prometheus does)."""

    __slots__ = ("target", "_bounds", "_counts", "_sum", "_n")

    def __init__(self, target: Any) -> None:
        self.target = target
        self._bounds = tuple(target._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._n = 0

    @staticmethod
    def supports(target: Any) -> bool:
        """Whether ``target`` has the internals folding writes to (else observe it directly)."""
        return all(hasattr(target, a) for a in ("_upper_bounds", "_buckets", "_sum"))

    def observe(self, amount: float) -> None:
        if amount != amount:  # NaN: prometheus adds it to the sum and to no bucket
            self._sum += amount
            return
        self._sum += amount
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._n += 1

    def fold(self) -> None:
        target = self.target
        if self._n or self._sum:
            target._sum.inc(self._sum)
            for i, c in enumerate(self._counts):
                if c:
                    target._buckets[i].inc(c)
                    self._counts[i] = 0
            self._sum = 0.0
            self._n = 0


def _fast(child: Any) -> Any:
    if isinstance(child, Counter):
        return FastCounter(child)
    if isinstance(child, Histogram) and FastHistogram.supports(child):
        return FastHistogram(child)
    return child


class _Fold:
    """Registered first in the registry: every collection folds the pending counts first."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self.metrics.fold()
        return []


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        r.register(_Fold(self))
        self.requests = Counter("kvatlas_router_requests", "Client requests by route and status",
                                ["route", "status"], registry=r)
        self.decisions = Counter("kvatlas_router_routing_decisions",
                                 "Requests routed to each instance", ["role", "instance"],
                                 registry=r)
        self.disagg_decisions = Counter(
            "kvatlas_router_disagg_decisions",
            "With PD pairs and aggregated workers both serving: requests by the path chosen "
            "(pd, aggregated) and why", ["path", "reason"], registry=r)
        self.vllm_pd_requests = Counter(
            "kvatlas_router_vllm_pd_requests",
            "Requests sent to vLLM-protocol PD pairs, by mode (pull, push) and outcome of the "
            "prefill's kv_transfer_params (given; missing: the decode computes the prompt "
            "itself, as vLLM does when its prefill aborted)", ["mode", "params"], registry=r)
        self.prefix_hit_tokens = Counter("kvatlas_router_prefix_hit_tokens",
                                         "Prompt tokens the chosen prefill was counted as "
                                         "holding: the sum of kvatlas_router_index_hit_tokens "
                                         "and kvatlas_router_predicted_hit_tokens", registry=r)
        # Apart, so that an index that never matches (a tokenizer unlike the engines') cannot
        # hide behind the router's own predictions, which match whatever ids it made up.
        self.index_hit_tokens = Counter("kvatlas_router_index_hit_tokens",
                                        "Prompt tokens the block index showed the chosen "
                                        "prefill holding", registry=r)
        self.predicted_hit_tokens = Counter("kvatlas_router_predicted_hit_tokens",
                                            "Prompt tokens counted as held by the chosen "
                                            "prefill on the router's own prediction only (not "
                                            "in the index, yet)", registry=r)
        self.untokenizable_models = Gauge("kvatlas_router_untokenizable_models",
                                          "1 for a model the router has no tokenizer for: its "
                                          "text and chat prompts are routed on load alone",
                                          ["model"], registry=r)
        self.load_only_requests = Counter("kvatlas_router_load_only_requests",
                                          "Text or chat requests routed on load alone because "
                                          "no tokenizer is known for their model", ["model"],
                                          registry=r)
        self.tokenizer_info = Gauge("kvatlas_router_tokenizer",
                                    "1 per model and the tokenizer the router hashes its prompts "
                                    "with", ["model", "source", "fingerprint"], registry=r)
        self.tokenizer_mismatch = Gauge("kvatlas_router_tokenizer_mismatch",
                                        "1 for an instance whose record names a tokenizer "
                                        "fingerprint other than the router's for its model",
                                        ["instance", "model", "router_fingerprint",
                                         "instance_fingerprint"], registry=r)
        self.index_ignored = Gauge("kvatlas_router_index_ignored",
                                   "1 while the router ignores an instance's block index "
                                   "entries because its block size, hash namespace or "
                                   "tokenizer differs from the router's for its model",
                                   ["instance", "model", "field", "router_value",
                                    "instance_value"], registry=r)
        self.canary = Counter("kvatlas_router_canary",
                              "Canary checks per prefill instance: a prompt it served, looked "
                              "up in the block index a little later (hit: the index holds its "
                              "first block there; miss: it does not)", ["instance", "result"],
                              registry=r)
        self.route_regret = Histogram(
            "kvatlas_router_route_regret_blocks",
            "Per prefill decision: the best overlap any candidate had minus the chosen one's, "
            "in blocks (load outweighed the rest)", registry=r, buckets=REGRET_BUCKETS)
        self.not_best_picks = Counter("kvatlas_router_not_best_overlap_picks",
                                      "Prefill picks whose overlap was below the best "
                                      "candidate's", registry=r)
        self.engine_cached_tokens = Counter(
            "kvatlas_router_engine_cached_tokens",
            "Cached prompt tokens the engines reported in their answers (compare with "
            "kvatlas_router_prefix_hit_tokens, what the router predicted)", registry=r)
        self.engine_queue = Gauge("kvatlas_router_engine_queue",
                                  "Queued requests the worker's engine reports (its /metrics)",
                                  ["role", "instance"], registry=r)
        self.engine_running = Gauge("kvatlas_router_engine_running",
                                    "Running requests the worker's engine reports",
                                    ["role", "instance"], registry=r)
        self.engine_kv_usage = Gauge("kvatlas_router_engine_kv_usage",
                                     "KV-cache usage (0..1) the worker's engine reports",
                                     ["role", "instance"], registry=r)
        self.busy_workers = Gauge("kvatlas_router_busy_workers",
                                  "Workers over a busy threshold (queue or KV usage)", ["role"],
                                  registry=r)
        self.busy_fallbacks = Counter("kvatlas_router_busy_fallbacks",
                                      "Decisions made among busy workers because every "
                                      "available one was busy", ["role"], registry=r)
        self.prompt_tokens = Counter("kvatlas_router_prompt_tokens", "Prompt tokens routed",
                                     registry=r)
        self.retries = Counter("kvatlas_router_retries", "Attempts after the first", ["route"],
                               registry=r)
        self.upstream_errors = Counter("kvatlas_router_upstream_errors",
                                       "Failed upstream attempts", ["role", "reason"], registry=r)
        self.client_disconnects = Counter("kvatlas_router_client_disconnects",
                                          "Requests abandoned because the client's connection "
                                          "closed before the answer was complete (both workers' "
                                          "requests are dropped; no breaker counts it)",
                                          ["route"], registry=r)
        self.breaker_state = Gauge("kvatlas_router_breaker_state",
                                   "Circuit state per worker (0 closed, 1 half-open, 2 open)",
                                   ["role", "instance"], registry=r)
        self.workers = Gauge("kvatlas_router_workers", "Workers per role and availability",
                             ["role", "available"], registry=r)
        self.worker_limit_ignored = Gauge(
            "kvatlas_router_worker_limit_ignored",
            "1 per limit a worker states (record or /server_info) that the router ignores as "
            "absurd: a prompt limit below the block size, a body limit below a minimal request",
            ["instance", "field", "value"], registry=r)
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
        self.index_shard_state = Gauge(
            "kvatlas_router_index_shard_state",
            "Per shard of a block index spread over several etcd clusters (--index-etcd): "
            "0 live, 1 stale (routing on its last known blocks: its etcd is unreachable), "
            "2 loading (never loaded: its instances match nothing)", ["shard", "endpoint"],
            registry=r)
        self.index_shard_blocks = Gauge("kvatlas_router_index_shard_blocks",
                                        "Blocks in the mirror of each index shard",
                                        ["shard", "endpoint"], registry=r)
        self.index_shard_instances = Gauge("kvatlas_router_index_shard_instances",
                                           "Instances holding blocks on each index shard",
                                           ["shard", "endpoint"], registry=r)
        self.shared_predictions = Counter(
            "kvatlas_router_shared_predictions",
            "Routing predictions shared between routers through etcd (sent: this router's; "
            "received: the other routers', taken; stale: theirs, too old to take)",
            ["direction"], registry=r)
        self.shared_prediction_puts = Counter("kvatlas_router_shared_prediction_puts",
                                              "etcd puts carrying this router's predictions",
                                              registry=r)
        self.shared_prediction_bytes = Counter("kvatlas_router_shared_prediction_bytes",
                                               "Bytes of the values of those puts", registry=r)
        self.etcd_values_skipped = Counter(
            "kvatlas_router_etcd_values_skipped",
            "etcd keys and values skipped as malformed by this process's watchers (block index "
            "mirrors, discovery, shared predictions), by prefix kind and reason; each is logged "
            "once", ["prefix_kind", "reason"], registry=r)
        self._skipped_counted: dict[tuple[str, str], int] = {}
        self.predicted_blocks = Gauge("kvatlas_router_predicted_blocks",
                                      "Router-side predicted (instance, block) entries",
                                      registry=r)

        # Label lookups cost microseconds each; the hot path reuses the children.
        self._children: dict[tuple[Any, ...], Any] = {}
        self.latency = {role: _fast(self.upstream_latency.labels(role))
                        for role in ("prefill", "decode", "aggregated")}
        # The unlabelled per-request metrics, counted the same cheap way.
        self.decision = _fast(self.decision_latency)
        self.prefix_hit = _fast(self.prefix_hit_tokens)
        self.index_hit = _fast(self.index_hit_tokens)
        self.predicted_hit = _fast(self.predicted_hit_tokens)
        self.prompt = _fast(self.prompt_tokens)
        self.regret = _fast(self.route_regret)
        self.not_best = _fast(self.not_best_picks)
        self.engine_cached = _fast(self.engine_cached_tokens)
        self._unlabelled = [*self.latency.values(), self.decision, self.prefix_hit,
                            self.index_hit, self.predicted_hit, self.prompt, self.regret,
                            self.not_best, self.engine_cached]

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, reused; counters and histograms come as their fast
        stand-ins (``inc``/``observe`` only)."""
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = _fast(metric.labels(*labels))
        return c

    def fold(self) -> None:
        """Move the counts taken since the last collection into the prometheus metrics."""
        for c in self._unlabelled:
            if hasattr(c, "fold"):
                c.fold()
        for c in self._children.values():
            if hasattr(c, "fold"):
                c.fold()

    def forget(self, role: str, instance: str) -> None:
        """Drop a departed worker's series so label sets stay bounded."""
        for metric in (self.decisions, self.breaker_state):
            self._children.pop((id(metric), role, instance), None)
            try:
                metric.remove(role, instance)
            except KeyError:
                pass

    def drop(self, metric: Any, *labels: str) -> None:
        """Remove one labelled series of ``metric`` (and its fast child), if present."""
        self._children.pop((id(metric), *labels), None)
        try:
            metric.remove(*labels)
        except KeyError:
            pass

    def set_engine_loads(self, workers: list, now: float, interval: float,
                         thresholds: Any) -> None:
        """The engines' reported load per worker (stale readings left out) and the busy
        count per role."""
        for g in (self.engine_queue, self.engine_running, self.engine_kv_usage):
            g.clear()
        busy = {"prefill": 0, "decode": 0}
        for w in workers:
            load = fresh(w.engine, now, interval)
            if load is None or w.shadowed_by is not None:
                continue
            self.engine_queue.labels(w.role, w.instance_id).set(load.queue)
            self.engine_running.labels(w.role, w.instance_id).set(load.running)
            if load.kv_usage is not None:
                self.engine_kv_usage.labels(w.role, w.instance_id).set(load.kv_usage)
            if thresholds.busy(load):
                busy[w.role] = busy.get(w.role, 0) + 1
        for role, n in busy.items():
            self.busy_workers.labels(role).set(n)

    def set_index_shards(self, shards: list[ShardStatus]) -> None:
        for sh in shards:
            labels = (str(sh.shard), sh.endpoint)
            self.index_shard_state.labels(*labels).set(SHARD_STATES[sh.state])
            self.index_shard_blocks.labels(*labels).set(sh.status.blocks)
            self.index_shard_instances.labels(*labels).set(sh.instances)

    def set_breakers(self, workers: list) -> None:
        """The gauges read off the pools' ``workers``: circuit states, workers per role and
        availability, and the limits ignored as absurd (router/limits.py)."""
        self.breaker_state.clear()
        self.worker_limit_ignored.clear()
        for w in workers:
            for name, value in w.limits.ignored:
                self.worker_limit_ignored.labels(w.instance_id, name, str(value)).set(1)
        counts: dict[tuple[str, str], int] = {}
        for w in workers:
            if w.shadowed_by is not None:
                continue  # its etcd twin is the worker, counted once (router/workers.py)
            self.breaker_state.labels(w.role, w.instance_id).set(STATE_CODES[w.breaker.state])
            key = (w.role, "true" if w.available else "false")
            counts[key] = counts.get(key, 0) + 1
        self.workers.clear()
        for (role, avail), n in counts.items():
            self.workers.labels(role, avail).set(n)

    def add_shared(self, delta: Any) -> None:
        """Count a ``ShareStats`` difference (router/shared_predictions.py)."""
        for direction, n in (("sent", delta.shared), ("received", delta.received),
                             ("stale", delta.stale)):
            if n:
                self.shared_predictions.labels(direction).inc(n)
        if delta.flushes:
            self.shared_prediction_puts.inc(delta.flushes)
        if delta.bytes:
            self.shared_prediction_bytes.inc(delta.bytes)

    def add_skipped(self) -> None:
        """Count the skips of etcd values taken since the last call (``index.follow``)."""
        for labels, n in skipped_totals().items():
            if n > self._skipped_counted.get(labels, 0):
                self.etcd_values_skipped.labels(*labels).inc(n - self._skipped_counted.get(labels, 0))
                self._skipped_counted[labels] = n

    def render(self) -> bytes:
        self.add_skipped()
        return generate_latest(self.registry)
