"""The router's shared state and its pair selection (no I/O here)."""
from __future__ import annotations

import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from index.mirror import BlockMirror
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.metrics import RouterMetrics
from router.policy import Choice, Policy, RouteContext, make_policy
from router.workers import DECODE, PREFILL, Worker, WorkerPools


class NoWorkers(Exception):
    """Nothing of ``role`` can be selected; ``reason`` says why (503)."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"No available servers: {reason}")
        self.role = role
        self.reason = reason


class UnknownModel(Exception):
    pass


@dataclass
class Pair:
    prefill: Choice
    decode: Choice


class RouterState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools = WorkerPools(config)
        self.metrics = RouterMetrics()
        self.rng = random.Random()
        self.mirror: BlockMirror | None = None
        self.discovery: InstanceDiscovery | None = None
        self.started_at = time.time()
        self.prefill_policy: Policy = make_policy(config.effective_prefill_policy,
                                                  config=config, lookup=self.index_lookup,
                                                  index_version=self.index_version)
        decode_name = config.effective_decode_policy
        # Decodes hold no reusable prefix: kv_aware on the decode side means load only.
        self.decode_policy: Policy = make_policy(
            "power_of_two" if decode_name == "kv_aware" else decode_name)
        self.pools.listeners.append(self._on_pool_change)
        for url, port in config.prefill:
            self.pools.add(PREFILL, url, bootstrap_port=port, model=config.model)
        for url in config.decode:
            self.pools.add(DECODE, url, model=config.model)

    def _on_pool_change(self, event: str, worker: Worker) -> None:
        if event == "leave":
            self.metrics.forget(worker.role, worker.instance_id)
            if worker.role == PREFILL:
                self.prefill_policy.forget(worker.instance_id)

    # --- index ----------------------------------------------------------------------------

    def index_lookup(self, hashes: Sequence[int], model: str | None) -> dict[str, int]:
        mirror = self.mirror
        if mirror is None or not mirror.ready:
            return {}
        if mirror.model is not None:
            return mirror.lookup(hashes)
        name = model or self.config.model or self._only_model(mirror)
        # Never create a table for a name taken from a request (memory would follow clients).
        table = mirror.tables.get(name) if name else None
        return table.lookup(hashes) if table is not None else {}

    def index_version(self) -> Hashable:
        """Changes whenever ``index_lookup`` may answer differently (table versions are unique
        process-wide; a table never written is empty)."""
        mirror = self.mirror
        if mirror is None or not mirror.ready:
            return None
        if mirror.model is not None:
            table = mirror.tables.get(mirror.model)
            return table.version if table is not None else 0
        return tuple((name, t.version) for name, t in mirror.tables.items())

    def _only_model(self, mirror: BlockMirror) -> str | None:
        """The model a request naming none means: the one the pools serve, or else the one
        the index holds, when there is exactly one (SGLang clients rarely send a model)."""
        served = self.pools.models()
        if len(served) == 1:
            return next(iter(served))
        if not served and len(mirror.tables) == 1:
            return next(iter(mirror.tables))
        return None

    def index_detail(self) -> dict[str, Any]:
        if self.config.etcd is None:
            return {"state": "off (no --etcd)"}
        mirror = self.mirror
        if mirror is None:
            return {"state": "starting"}
        disc = self.discovery.stats() if self.discovery else {}
        # Discovery follows the same etcd: when it is degraded, the mirror is not updating either.
        # A mirror that lost its watch or quorum serves its last state: routing goes on, flagged.
        stale = disc.get("state") == "degraded" or (mirror.ready and not mirror.connected)
        return {"state": ("stale" if stale else "live") if mirror.ready else "loading",
                "connected": mirror.connected,
                "blocks": sum(len(t) for t in mirror.tables.values()),
                "revision": mirror.revision, "revision_lag": mirror.revision_lag,
                "disconnects": mirror.disconnects, "last_error": mirror.last_error,
                "discovery": disc}

    def check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = self.pools.models()
        if known and model not in known:
            raise UnknownModel(f"model {model!r} is not served here; known: {sorted(known)}")

    # --- selection ------------------------------------------------------------------------

    def _available(self, role: str, exclude: set[str] | None) -> list[Worker]:
        workers = [w for w in self.pools.workers[role].values() if w.available]
        if not workers:
            raise NoWorkers(role, self.pools.unavailable_reason(role))
        if not exclude:
            return workers
        # Avoid workers that already failed this request while others remain.
        fresh = [w for w in workers if w.instance_id not in exclude]
        return fresh or workers

    def select_pair(self, ctx: RouteContext, exclude: set[str] | None = None) -> Pair:
        t0 = time.perf_counter()
        prefills = self._available(PREFILL, exclude)
        decodes = self._available(DECODE, exclude)
        pair = Pair(self.prefill_policy.select(prefills, ctx),
                    self.decode_policy.select(decodes, ctx))
        self.metrics.decision.observe(time.perf_counter() - t0)
        return pair

    def on_routed(self, pair: Pair) -> None:
        m = self.metrics
        p, d = pair.prefill, pair.decode
        self.prefill_policy.on_routed(p)
        m.child(m.decisions, PREFILL, p.worker.instance_id).inc()
        m.child(m.decisions, DECODE, d.worker.instance_id).inc()
        bs = self.config.block_size
        m.prefix_hit.inc(p.matched_blocks * bs)
        m.prompt.inc(p.prompt_blocks * bs)

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.set_breakers(self.pools.all())
        mirror = self.mirror
        if mirror is not None:
            m.index_ready.set(1 if mirror.ready else 0)
            m.index_blocks.set(sum(len(t) for t in mirror.tables.values()))
            m.index_revision_lag.set(mirror.revision_lag)
            m.index_stale.set(1 if self.index_detail().get("state") == "stale" else 0)
        prediction = getattr(self.prefill_policy, "prediction", None)
        if prediction is not None:
            m.predicted_blocks.set(len(prediction))
