"""Prometheus metrics of one engine, read from the scheduler at scrape time (one registry per app,
so several engines in one process never share counters)."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.runner import AsyncEngine
from index.follow import skipped_totals

PREFIX = "kvatlas_engine"


class EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        sched = self.engine.scheduler
        cache = sched.cache
        t = dict(sched.totals)
        labels = ["model_name"]
        val = [self.model_name]

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            m.add_metric(val, value)
            return m

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
            m.add_metric(val, value)
            return m

        yield counter("prompt_tokens", "Prompt tokens of admitted requests", t["prompt_tokens"])
        yield counter("cached_tokens", "Prompt tokens served from the prefix cache",
                      t["cached_tokens"])
        yield counter("prefill_computed_tokens", "Prompt tokens actually computed",
                      t["prefill_computed_tokens"])
        yield counter("generation_tokens", "Generated tokens", t["generated_tokens"])
        yield counter("requests", "Requests admitted", t["requests"])
        yield counter("aborted_requests", "Requests aborted", t["aborted"])
        yield counter("kv_events_published", "KV events published", self.engine.events_published)
        yield counter("kv_evictions", "Cached blocks evicted", cache.evictions)
        yield counter("kv_host_stores", "Evicted blocks copied to the host tier",
                      cache.host_stores)
        yield counter("kv_host_restores", "Host-tier blocks copied back for a request",
                      cache.host_restores)
        yield gauge("kv_host_blocks", "Blocks held in the host tier", cache.host_blocks)
        yield gauge("kv_pages_used", "KV pages referenced by requests", cache.pages_in_use)
        yield gauge("kv_pages_cached", "KV pages holding cached blocks", len(cache.blocks()))
        yield gauge("kv_pages_total", "KV pool capacity in pages", sched.pool.num_pages)
        yield gauge("queue_length", "Requests waiting for admission", len(sched.waiting))
        yield gauge("running_requests", "Requests admitted and not finished", len(sched.running))
        # The process's etcd watchers (a decode's prefill-restart watch, a prefill's bootstrap
        # mirror) skip malformed keys and values rather than stop: this says how many, and why.
        skipped = CounterMetricFamily(f"{PREFIX}_etcd_values_skipped",
                                      "etcd keys and values skipped as malformed by this "
                                      "process's watchers", labels=["prefix_kind", "reason"])
        for (kind, reason), n in sorted(skipped_totals().items()):
            skipped.add_metric([kind, reason], n)
        yield skipped


def make_registry(engine: AsyncEngine, model_name: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine, model_name))
    return reg
