"""The router's shared state and its pair selection (no I/O here)."""
from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from index.hashing import BASE_SEED
from index.pd_protocol import SGLANG, SGLANG_BOOTSTRAP, VLLM, PDProtocol
from index.reader import IndexReader, IndexStatus
from index.tiers import TierMatch
from router.canary import Canaries
from router.capacity import Capacity, Need, NoRoom
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.engine_load import Thresholds, fresh
from router.errors import BadRequest, NoWorkers, UnknownModel
from router.index_guards import IndexGuards
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.policy import Choice, Policy, RouteContext
from router.requests import several_samples
from router.shared_predictions import ShareStats
from router.tokenizers import Tokenizers
from router.workers import AGGREGATED, DECODE, PREFILL, Worker, WorkerPools

SGLANG_KEY = SGLANG_BOOTSTRAP.pair_key
PD, AGGREGATED_SHAPE = "pd", "aggregated"
"""The two shapes a request can be served in: a prefill/decode pair, or one aggregated worker."""


@dataclass
class Pair:
    """Where one request goes: ``prefill`` computes its prompt; ``decode`` generates from the
    KV it is sent. ``decode`` None: ``prefill`` is an aggregated worker that serves the whole
    request (no bootstrap fields)."""

    prefill: Choice
    decode: Choice | None
    why: dict[str, Any] | None = None
    """With both shapes serving: the per-request choice between them (``path``, ``reason``,
    and each candidate's uncached tokens); None: only one shape could serve."""

    @property
    def shape(self) -> str:
        return PD if self.decode is not None else AGGREGATED_SHAPE


class RouterState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.pools = WorkerPools(config)
        self.metrics = RouterMetrics()
        self.rng = random.Random()
        self.index: IndexReader | None = None
        """The block index (the etcd mirror, with --etcd), read through ``IndexReader`` only."""
        self.discovery: InstanceDiscovery | None = None
        self.shared: ShareStats | None = None
        """Predictions shared with the other routers (with etcd and kv_aware)."""
        self._shared_counted = ShareStats()
        self.started_at = time.time()
        self.prefill_policy: Policy = make_policy(config.effective_prefill_policy,
                                                  config=config, lookup=self.index_lookup,
                                                  index_version=self.index_version,
                                                  tier_lookup=self.index_lookup_tiers)
        decode_name = config.effective_decode_policy
        # Decodes hold no reusable prefix: kv_aware on the decode side means load only.
        self.decode_policy: Policy = make_policy(
            "power_of_two" if decode_name == "kv_aware" else decode_name)
        self.pools.listeners.append(self._on_pool_change)
        self.tokenizers = Tokenizers(config, self.metrics, self.default_model)
        """Per model, the tokenizer text prompts are encoded with (``start`` loads the flags')."""
        self.pools.listeners.append(self.tokenizers.on_worker)
        self.thresholds = Thresholds(config.busy_queue, config.busy_kv_usage,
                                     config.disagg_tokens)
        """Busy thresholds (router/engine_load.py); ``PUT /admin/thresholds`` changes them."""
        self.guards = IndexGuards(config, self.metrics)
        """Instances whose index entries are not used (another block size, namespace or
        tokenizer than the router's): ``index_lookup`` leaves them out."""
        self.pools.listeners.append(self.guards.on_worker)
        self.tokenizers.mismatch_listeners.append(self.guards.on_tokenizer)
        self.canaries = Canaries(config, self.metrics, self.index_match, self._index_live,
                                 self.guards.is_ignored)
        self.pools.listeners.append(self.canaries.on_worker)
        self.capacity = Capacity(config.worker_admission, config.worker_queue_size,
                                 config.worker_queue_timeout)
        """What each worker states it holds and what the router's requests hold there; the
        queue of requests waiting for room (router/capacity.py)."""
        self.pools.listeners.append(self.capacity.on_worker)
        static = PDProtocol.parse(config.pd_protocol)
        for url, port in config.prefill:
            self.pools.add(PREFILL, url, bootstrap_port=port, model=config.model,
                           protocol=static)
        for url in config.decode:
            self.pools.add(DECODE, url, model=config.model, protocol=static)
        for url in config.worker_urls:
            self.pools.add(AGGREGATED, url, model=config.model)

    def _on_pool_change(self, event: str, worker: Worker) -> None:
        if event == "leave":
            self.metrics.forget(worker.role, worker.instance_id)
            # A decode that prefilled locally has predictions and work there too.
            self.prefill_policy.forget(worker.instance_id)

    # --- index ----------------------------------------------------------------------------

    def index_lookup(self, hashes: Sequence[int], model: str | None) -> dict[str, int]:
        """What kv_aware reads: the index's match, less the instances the guards ignore."""
        found = self.index_match(hashes, model)
        return self.guards.filter(found) if found else found

    def index_lookup_tiers(self, hashes: Sequence[int], model: str | None
                           ) -> dict[str, TierMatch]:
        """``index_lookup`` with each match split by cache tier (kv_aware's cost reads it)."""
        index = self.index
        if index is None or not index.ready:
            return {}
        name = index.model or model
        found = index.match_tiers(name, hashes) if name else {}
        return self.guards.filter(found) if found else found

    def index_match(self, hashes: Sequence[int], model: str | None) -> dict[str, int]:
        """The index's match for a request's ``model``, every instance included."""
        index = self.index
        if index is None or not index.ready:
            return {}
        # An index of one model answers for it whatever the request names (the pools serve
        # that model only); otherwise the model the request is routed as (``default_model``).
        name = index.model or model
        # An unknown name answers {} without growing the index (memory would follow clients).
        return index.match(name, hashes) if name else {}

    def _index_live(self) -> bool:
        index = self.index
        return index is not None and index.ready and index.connected

    def on_served(self, pair: Pair, ctx: RouteContext) -> None:
        """A request routed to ``pair`` was answered: its prefill may get a canary."""
        p = pair.prefill
        self.canaries.served(p.worker, ctx.tokens, ctx.model, p.hashes)

    def index_health(self) -> dict[str, Any]:
        """``GET /debug/index_health``: per worker, what it served and what the index shows
        of it, whether its entries are ignored and why, and its canaries."""
        index = self.index
        instances: dict[str, Any] = {}
        for w in self.pools.all():
            detail = index.instance(w.instance_id) if index is not None else None
            st = self.canaries.stats(w.instance_id)
            instances[w.instance_id] = {
                "role": w.role, "model": w.model, "url": w.url, "source": w.source,
                "shadowed_by": w.shadowed_by, "requests": w.requests,
                "requests_with_blocks": st.requests_with_blocks,
                "index_blocks": sum(detail.blocks.values()) if detail is not None else 0,
                "ignored": [m.describe() for m in self.guards.mismatches(w.instance_id)],
                "canary": st.describe()}
        return {"block_size": self.config.block_size, "hash_seed": BASE_SEED,
                "instances": instances}

    def index_version(self) -> Hashable:
        """Changes whenever ``index_lookup`` may answer differently."""
        index = self.index
        if index is None or not index.ready:
            return None
        return index.version()

    def default_model(self) -> str | None:
        """The model a request naming none is routed as (SGLang clients rarely send one):
        ``--model``, else the one model the pools serve, else the one the index holds."""
        if self.config.model is not None:
            return self.config.model
        served = self.pools.models()
        if len(served) == 1:
            return next(iter(served))
        index = self.index
        if not served and index is not None and index.ready:
            held = index.models()
            if len(held) == 1:
                return next(iter(held))
        return None

    def index_detail(self) -> dict[str, Any]:
        if self.config.etcd is None:
            return {"state": "off (no --etcd)"}
        index = self.index
        if index is None:
            return {"state": "starting"}
        disc = self.discovery.stats() if self.discovery else {}
        st = index.status()
        detail: dict[str, Any] = {
            "state": ("stale" if self._index_stale(st) else "live") if st.ready else "loading",
            "connected": st.connected, "blocks": st.blocks,
            "revision": st.revision, "revision_lag": st.revision_lag,
            "disconnects": st.disconnects, "last_error": st.last_error,
            "discovery": disc}
        shards = index.shards()
        if shards:
            # Spread over several etcd clusters: which shard is behind says whose blocks are.
            detail["shards"] = [{
                "shard": sh.shard, "endpoint": sh.endpoint, "state": sh.state,
                "instances": sh.instances, "blocks": sh.status.blocks,
                "revision": sh.status.revision, "revision_lag": sh.status.revision_lag,
                "last_error": sh.status.last_error} for sh in shards]
            detail["stale_shards"] = [sh.shard for sh in shards if sh.state != "live"]
        return detail

    def _index_stale(self, st: IndexStatus) -> bool:
        # Discovery follows the same etcd: when it is degraded, the mirror is not updating either.
        # A mirror that lost its watch or quorum serves its last state: routing goes on, flagged.
        degraded = self.discovery is not None and self.discovery.state == "degraded"
        return degraded or (st.ready and not st.connected)

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
        th = self.thresholds
        if th.busy_queue is not None or th.busy_kv_usage is not None:
            workers = self._not_busy(role, workers)
        if not exclude:
            return workers
        # Avoid workers that already failed this request while others remain.
        fresh = [w for w in workers if w.instance_id not in exclude]
        return fresh or workers

    def _not_busy(self, role: str, workers: list[Worker]) -> list[Worker]:
        """The workers under the busy thresholds; all of them when every one is busy (a
        request waits at a busy engine rather than fail here), counted."""
        now, interval, busy = time.monotonic(), self.config.load_interval, self.thresholds.busy
        free = [w for w in workers if not busy(fresh(w.engine, now, interval))]
        if free:
            return free
        m = self.metrics
        m.child(m.busy_fallbacks, role).inc()
        return workers

    def select_pair(self, ctx: RouteContext, exclude: set[str] | None = None,
                    need: Need | None = None, unfit: frozenset[str] = frozenset()) -> Pair:
        """Where ``ctx`` goes: a PD pair or an aggregated worker, whichever the pools hold; with
        both, chosen per request (``_choose``). With ``need``, among the workers with room for
        it (NoRoom when none has: the request waits, router/capacity.py)."""
        t0 = time.perf_counter()
        pd, aggregated = self.pools.shapes()
        if ctx.samples is not None:  # n > 1: one room carries one sample's KV
            if not aggregated:
                raise several_samples(*ctx.samples)
            pd = False
        if aggregated and not pd:
            pair = Pair(self._select_aggregated(ctx, exclude, need, unfit), None)
        elif pd and aggregated:
            pair = self._choose(ctx, exclude, need, unfit)
        else:
            pair = self._select_pd(ctx, exclude, need, unfit)
        self.metrics.decision.observe(time.perf_counter() - t0)
        return pair

    def _choose(self, ctx: RouteContext, exclude: set[str] | None, need: Need | None,
                unfit: frozenset[str]) -> Pair:
        """The per-request choice between the shapes. PD when the part of the prompt that the
        best aggregated candidate lacks is at least ``disagg_tokens`` (a dedicated prefill
        pays for the hop and the decode keeps generating undisturbed); aggregated below it,
        and also when every prefill is busy and the aggregated candidate is not. A shape that
        cannot serve now (no worker available or with room) leaves the other."""
        try:
            agg: Choice | None = self._select_aggregated(ctx, exclude, need, unfit)
        except (NoWorkers, NoRoom):
            agg = None
        try:
            pd: Pair | None = self._select_pd(ctx, exclude, need, unfit)
        except (NoWorkers, NoRoom, BadRequest):
            # BadRequest: no pair here speaks a protocol that carries this request (a
            # /generate with vLLM pairs only); an aggregated worker still serves it.
            if agg is None:
                raise
            pd = None
        bs = self.config.block_size
        why: dict[str, Any] = {}
        if agg is not None:
            why["aggregated"] = {"worker": agg.worker.instance_id, "uncached_tokens":
                                 (agg.prompt_blocks - agg.matched_blocks) * bs}
        if pd is not None:
            p = pd.prefill
            why["pd"] = {"prefill": p.worker.instance_id, "uncached_tokens":
                         (p.prompt_blocks - p.matched_blocks) * bs}
        if agg is None:
            reason = "aggregated_unavailable"
        elif pd is None:
            reason = "pd_unavailable"
        elif why["aggregated"]["uncached_tokens"] < self.thresholds.disagg_tokens:
            reason = "short_uncached"
        elif self._busy(pd.prefill.worker) and not self._busy(agg.worker):
            reason = "prefill_busy"
        else:
            reason = "long_uncached"
        path = PD if reason in ("aggregated_unavailable", "long_uncached") else AGGREGATED_SHAPE
        why.update(path=path, reason=reason, disagg_tokens=self.thresholds.disagg_tokens)
        m = self.metrics
        m.child(m.disagg_decisions, path, reason).inc()
        if path == PD:
            assert pd is not None
            pd.why = why
            return pd
        assert agg is not None
        return Pair(agg, None, why)

    def _busy(self, worker: Worker) -> bool:
        """Its engine reports itself busy by the thresholds (a busy threshold must be set)."""
        th = self.thresholds
        if th.busy_queue is None and th.busy_kv_usage is None:
            return False
        return th.busy(fresh(worker.engine, time.monotonic(), self.config.load_interval))

    def _select_aggregated(self, ctx: RouteContext, exclude: set[str] | None,
                           need: Need | None, unfit: frozenset[str]) -> Choice:
        """A worker to serve ``ctx`` whole: an aggregated one, or a decode that prefills
        locally (sent the request with ``X-Kvatlas-Prefill: local``)."""
        workers = self._whole_workers(exclude)
        if unfit:
            workers = self.pools.fitting(AGGREGATED, workers, unfit)
        if need is not None:
            # It holds the prompt and what it generates, as a decode does.
            workers = self.capacity.with_room(workers, need, True, AGGREGATED)
        return self.prefill_policy.select(workers, ctx)

    def _whole_workers(self, exclude: set[str] | None) -> list[Worker]:
        try:
            workers = self._available(AGGREGATED, exclude)
        except NoWorkers:
            workers = []
        if any(w.local_prefill for w in self.pools.workers[DECODE].values()):
            try:
                workers += [w for w in self._available(DECODE, exclude) if w.local_prefill]
            except NoWorkers:
                pass
        if not workers:
            raise NoWorkers(AGGREGATED, self.pools.unavailable_reason(AGGREGATED))
        return workers

    def _select_pd(self, ctx: RouteContext, exclude: set[str] | None, need: Need | None,
                   unfit: frozenset[str]) -> Pair:
        prefills = self._available(PREFILL, exclude)
        decodes = self._available(DECODE, exclude)
        if unfit:  # workers whose own limits the request exceeds (router/limits.py)
            prefills = self.pools.fitting(PREFILL, prefills, unfit)
            decodes = self.pools.fitting(DECODE, decodes, unfit)
        if need is not None:
            room = self.capacity.with_room
            prefills = room(prefills, need, False, PREFILL)
            decodes = room(decodes, need, True, DECODE)
        prefills = self._protocol_matched(prefills, decodes, ctx)
        prefill = self.prefill_policy.select(prefills, ctx)
        key = prefill.worker.protocol.pair_key
        decodes = [d for d in decodes if d.protocol.pair_key == key]
        return Pair(prefill, self.decode_policy.select(decodes, ctx))

    def _protocol_matched(self, prefills: list[Worker], decodes: list[Worker],
                          ctx: RouteContext) -> list[Worker]:
        """The prefills that can serve ``ctx`` with one of ``decodes``: a pair's halves speak
        the same PD protocol and mode (index/pd_protocol.py), vLLM's only for an OpenAI request
        of one prompt, and a push prefill only once its identity is known."""
        keys = {d.protocol.pair_key for d in decodes}
        if keys == {SGLANG_KEY} and all(p.protocol.name == SGLANG for p in prefills):
            return prefills  # the common fleet: one protocol, nothing to match
        fit = [p for p in prefills if p.protocol.pair_key in keys
               and (p.protocol.name == SGLANG or ctx.vllm_pd)
               and not p.protocol.missing_identity()]
        if fit:
            return fit
        # No SGLang pair can serve (it would be in ``fit``): a request vLLM's protocol cannot
        # carry is the client's to change when vLLM pairs are what the fleet has.
        if not ctx.vllm_pd and any(p.protocol.name == VLLM for p in prefills):
            raise BadRequest("", "the PD pairs here speak vLLM's protocol, which serves "
                             "/v1/completions and /v1/chat/completions with one prompt each: "
                             "send the request there")
        raise NoWorkers(PREFILL, "no prefill has an available decode of its PD protocol "
                        f"(prefills: {_labels(prefills)}; decodes: {_labels(decodes)})")

    def on_routed(self, pair: Pair) -> None:
        m = self.metrics
        p, d = pair.prefill, pair.decode
        self.prefill_policy.on_routed(p)
        m.child(m.decisions, p.worker.role, p.worker.instance_id).inc()
        if d is not None:
            m.child(m.decisions, DECODE, d.worker.instance_id).inc()
        bs = self.config.block_size
        m.prefix_hit.inc(p.matched_blocks * bs)
        m.index_hit.inc(p.indexed_blocks * bs)
        m.predicted_hit.inc((p.matched_blocks - p.indexed_blocks) * bs)
        m.prompt.inc(p.prompt_blocks * bs)
        regret = p.best_matched - p.matched_blocks
        m.regret.observe(regret)
        if regret > 0:
            m.not_best.inc()

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.set_breakers(self.pools.all())
        m.set_engine_loads(self.pools.all(), time.monotonic(), self.config.load_interval,
                           self.thresholds)
        index = self.index
        if index is not None:
            st = index.status()
            m.index_ready.set(1 if st.ready else 0)
            m.index_blocks.set(st.blocks)
            m.index_revision_lag.set(st.revision_lag)
            m.index_stale.set(1 if st.ready and self._index_stale(st) else 0)
            m.set_index_shards(index.shards())
        if self.shared is not None:
            m.add_shared(self.shared.since(self._shared_counted))
            self._shared_counted = dataclasses.replace(self.shared)
        predicted = self.prefill_policy.predicted_blocks()
        if predicted is not None:
            m.predicted_blocks.set(predicted)


def _labels(workers: list[Worker]) -> str:
    """The PD protocols of ``workers``, each with its count, for an error message."""
    counts: dict[str, int] = {}
    for w in workers:
        label = w.protocol.label
        if w.protocol.missing_identity():
            label += " without " + "/".join(w.protocol.missing_identity())
        counts[label] = counts.get(label, 0) + 1
    return ", ".join(f"{n} {label}" for label, n in sorted(counts.items())) or "none"
