"""The kv_aware prefill policy: longest cached prefix (etcd mirror + predictions) vs load.

Cost (Dynamo's model, every term in prefill blocks so that they compare)::

    cost(i) = (prompt blocks - blocks i holds) x overlap_weight + load_blocks(i)

(``overlap_weight`` defaults to 2: a hit saves its compute now and a duplicate of the prefix in
another cache later; see ``RouterConfig.overlap_weight``.)

Lowest cost wins; equal costs go to the instance with fewer in-flight requests, then at random.
With a temperature the choice is sampled from a softmax over the normalized costs (Dynamo's).

**Load in blocks.** ``load_blocks(i)`` is prefill work, not a request count, so that it weighs
against the overlap term in the same unit:

- *in flight*: the blocks left to compute (prompt blocks - matched) of the requests routed to
  ``i`` that are still running. The dispatcher counts running requests in ``Worker.load``; the
  policy keeps the work of each routed request in order and, at every decision, keeps the
  newest ``Worker.load`` of them as running (prefills finish roughly in order). A running
  request the policy did not route counts one block.
- *recent*: the work of requests that finished, decayed with a half-life of ``work_half_life``
  seconds. Without it, at concurrency 1 nothing is ever in flight when a decision is made and the
  first block (BOS + chat header, shared by every prompt) gives whichever instance served first
  a one-block advantage for ever: every new conversation would pile onto it and thrash its
  cache while the others stay empty. With it, a new conversation goes to the instance that did
  the least recent prefill work, while a real long-prefix hit (more blocks saved than the work
  imbalance) still wins.

**Router-side prediction: a bridge until the index catches up, not a second index.** The blocks
of a routed prompt count as held by the chosen instance (so that a same-prefix burst sticks to
one instance before the engine's KV events made the round trip through etcd) under this rule:

- an instance whose events the index has never shown (no index, static workers that publish
  nothing): predictions are the only signal and count for ``prediction_ttl`` seconds. The index
  "shows" an instance once a lookup returns it, or once it confirms one of its predictions;
- an instance the index knows: a prediction counts only while it is younger than
  ``prediction_catch_up`` seconds AND the index has not yet caught up with it. The index has
  caught up with a routed prompt once it shows the instance holding that prompt's last block
  (which was not indexed there when it was routed). Engines publish their events in order and
  the mirror applies them in revision order, so that also settles every older prediction for
  that instance: those of its blocks the index does not show were evicted (or never stored)
  and must not be resurrected. A prompt already fully indexed on the instance when routed
  predicts nothing.

Other routers publish their predictions (``router.shared_predictions``); each counts here as
held like an own one, settled by time alone (``prediction_catch_up`` once the index shows the
instance), and without the load discount below: its request is in another router's load.

``prediction_ttl`` stays the hard bound on how long any prediction is kept; the entries live in
a ``BlockTable`` (the index's own structure, same lookup cost), ``prediction_max_blocks`` bounds
their number.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from index.hashing import namespace_seed
from index.tiers import TierMatch
from router.config import RouterConfig
from router.engine_load import fresh
from router.policy import Choice, Policy, RouteContext
from router.predictions import Prediction
from router.prompt_hashes import shared_hasher
from router.work_load import WorkLoad
from router.workers import PREFILL, Worker

Lookup = Callable[[Sequence[int], "str | None"], dict[str, int]]
"""The block index read path: ``(prompt hashes, model) -> {instance: leading blocks held}``."""
TierLookup = Callable[[Sequence[int], "str | None"], dict[str, TierMatch]]
"""The same, each instance's match split by cache tier (``index.tiers``)."""



class Score(NamedTuple):
    """One candidate of a decision: what its cost is made of (and /debug/route shows)."""

    cost: float
    """(prompt blocks - matched) x overlap_weight + load_blocks: lowest wins."""
    load: int
    """In-flight requests (``Worker.load``): breaks cost ties."""
    matched: int
    """Leading prompt blocks counted as held there (index or prediction)."""
    worker: Worker
    load_blocks: float
    """Prefill work in blocks (``WorkLoad``), less the predicted blocks this prompt reuses."""
    indexed: int
    """Of ``matched``, the blocks the index shows."""
    predicted: int
    """Leading blocks the predictions (this router's or another's) count as held there (index
    aside)."""
    tiers: TierMatch | None
    """The index's match there by cache tier (None: no index match)."""
    credited: float
    """The matched blocks the cost credits: a device block 1, a host or disk block its tier's
    weight (``RouterConfig.tier_weights``); predicted blocks are being computed on the device."""


# A Score without the generated __new__'s Python frame: this runs once per candidate per
# decision (``Score(...)`` costs twice as much; bench/router.py part 2 measures the decision).
_score = tuple.__new__

# How many of an instance's newest pending predictions one decision checks against the index.
CONFIRM_SCAN = 8
# No index version available: every catch-up asks the index.
_UNVERSIONED: Any = object()


class KvAware(Policy):
    name = "kv_aware"

    def __init__(self, config: RouterConfig, lookup: Lookup | None = None,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 index_version: Callable[[], Hashable] | None = None,
                 tier_lookup: TierLookup | None = None) -> None:
        super().__init__(rng)
        self.config = config
        self.lookup = lookup
        self.tier_lookup = tier_lookup
        """Optional: the index's match by tier; without it every index block is a device one."""
        self.weights = config.tier_weights
        self._gated = (config.cache_threshold is not None
                       or config.balance_abs_threshold is not None)
        """sglang-router's thresholds are set (``_gate``): off, a decision never reads them."""
        self.index_version = index_version
        """Optional: a value that changes whenever ``lookup``'s answers may change. With it, a
        prediction found unconfirmed is not asked about again until the index changes."""
        # Per instance: (index version, newest pending seq found unconfirmed at that version).
        self._unconfirmed: dict[str, tuple[Hashable, int]] = {}
        self.seed = namespace_seed()
        self.hasher = shared_hasher(config.block_size)
        self._clock = clock
        self.prediction = Prediction(config.prediction_ttl, config.prediction_max_blocks, clock)
        self.peer = Prediction(config.prediction_ttl, config.prediction_max_blocks, clock)
        """Other routers' predictions (router/shared_predictions.py): held the same way as this
        router's own, but the requests they stand for are not in this router's load."""
        self.share: Callable[[str, str | None, Sequence[int]], None] | None = None
        """Where this router's new predictions go for the other routers (None: nowhere)."""
        self.work = WorkLoad(config.work_half_life, clock)
        self.mean_work = 1.0
        """Blocks of prefill work per routed request (a moving average): what one request an
        engine reports but this router did not send is taken to cost."""
        # Instances whose blocks the index has shown: their predictions only bridge its lag.
        self._indexed: set[str] = set()
        # Per instance: (prediction seq, model, last hash) of predictions not yet confirmed.
        self._pending: dict[str, deque[tuple[int, str | None, int]]] = {}

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        cfg = self.config
        now = self._clock()
        hashes = ctx.hashes(self.hasher, self.seed)
        n = len(hashes)
        lookup = self.lookup
        tiers: dict[str, TierMatch] = {}
        if self.tier_lookup is not None and n:
            tiers = self.tier_lookup(hashes, ctx.model)
            indexed = {iid: t.blocks for iid, t in tiers.items()}
        else:
            indexed = lookup(hashes, ctx.model) if (lookup and n) else {}
        known, pending = self._indexed, self._pending
        if indexed:
            known.update(indexed)
        if known or pending:
            version = _UNVERSIONED
            for w in workers:
                iid = w.instance_id
                if iid in known or iid in pending:
                    if version is _UNVERSIONED and self.index_version is not None:
                        version = self.index_version()
                    self._catch_up(iid, now, version)
        predicted = self.prediction.lookup(hashes) if n else {}
        peer = self.peer.lookup(hashes) if n and len(self.peer) else None
        weight = cfg.overlap_weight
        work = self.work.blocks
        scored: list[Score] = []
        weights = self.weights
        top = 0
        for w in workers:
            iid = w.instance_id
            m_index = indexed.get(iid, 0) if indexed else 0
            m_own = m_pred = predicted.get(iid, 0) if predicted else 0
            if peer:
                m_peer = peer.get(iid, 0)
                if m_peer > m_pred:
                    m_pred = m_peer
            tier = tiers.get(iid) if tiers else None
            load = work(w, now)
            if w.engine is not None:
                load += self._unseen_work(w, now)
            if m_pred > m_index:
                m = m_pred
                if m_own > m_index:
                    # Own predicted-only blocks are being (or were just) computed there by
                    # requests counted in its load: this prompt needs them anyway, so they do
                    # not delay it. (A peer's requests are not in this router's load.)
                    load -= m_own - m_index
                credited = float(m)
            else:
                m = m_index
                # A host or disk block saves less than a device one: it is copied, not reused.
                credited = float(m) if tier is None or tier.device == m else tier.credit(weights)
            if load < 0.0:
                load = 0.0
            if m > top:
                top = m
            scored.append(_score(Score, ((n - credited) * weight + load, w.load, m, w, load,
                                         m_index, m_pred, tier, credited)))
        gated = self._gate(scored, n, top) if self._gated and len(scored) > 1 else None
        if gated is not None:
            pick = gated
        elif cfg.temperature > 0 and len(scored) > 1:
            pick = self._sample(scored, cfg.temperature)
        else:
            # Lowest (cost, in-flight requests); ties in pool order, drawn at random.
            first = scored[0]
            ties = [first]
            best = (first.cost, first.load)
            for s in scored[1:]:
                key = (s.cost, s.load)
                if key < best:
                    best, ties = key, [s]
                elif key == best:
                    ties.append(s)
            pick = self.rng.choice(ties)
        return Choice(pick.worker, lambda: _candidates(scored), matched_blocks=pick.matched,
                      prompt_blocks=n, hashes=hashes, indexed_blocks=pick.indexed,
                      model=ctx.model, best_matched=top)

    def _gate(self, scored: list[Score], n: int, top: int) -> Score | None:
        """sglang-router's cache_aware thresholds, when set: the least loaded candidate (fewest
        requests in flight, then lowest cost) when the load is out of balance, or when no
        candidate holds ``cache_threshold`` of the prompt; None: the cost decides."""
        cfg = self.config
        loads = [s.load for s in scored]
        hi, lo = max(loads), min(loads)
        abs_t, rel_t = cfg.balance_abs_threshold, cfg.balance_rel_threshold
        unbalanced = (abs_t is not None and hi - lo > abs_t
                      and (rel_t is None or hi > rel_t * lo))
        if not unbalanced and not (cfg.cache_threshold is not None and n
                                   and top < cfg.cache_threshold * n):
            return None
        return min(scored, key=lambda s: (s.load, s.cost))

    def _unseen_work(self, worker: Worker, now: float) -> float:
        """Work queued at ``worker`` that this router did not send (other routers' requests,
        direct clients): the requests its engine reports waiting, less this router's own that
        are not running yet, at the mean work of a request. Running requests are left out: a
        batching engine takes a new request beside them, and counting them made two routers
        shun each other's prefix holders (bench/routing_quality.py --router-counts 1,2: 0.78
        of one router's cached tokens when running requests counted)."""
        load = fresh(worker.engine, now, self.config.load_interval)
        if load is None:
            return 0.0
        own_waiting = worker.load - load.running
        unseen = load.queue - (own_waiting if own_waiting > 0 else 0)
        return unseen * self.mean_work if unseen > 0 else 0.0

    def _catch_up(self, instance: str, now: float, version: Hashable = _UNVERSIONED) -> None:
        """Settle ``instance``'s predictions the index has caught up with or that are too old."""
        pending = self._pending.get(instance)
        confirmed = None
        if pending and self.lookup is not None:
            # Pending entries only come and go at the ends, so those the last scan found
            # unconfirmed at this same index version stay unconfirmed: the scan stops at them.
            seen = -1
            if version is not _UNVERSIONED:
                last_scan = self._unconfirmed.get(instance)
                if last_scan is not None and last_scan[0] == version:
                    seen = last_scan[1]
            # The newest confirmed prediction settles every older one (events are in order).
            for k in range(len(pending) - 1, max(len(pending) - 1 - CONFIRM_SCAN, -1), -1):
                seq, model, last = pending[k]
                if seq <= seen:
                    break
                if instance in self.lookup((last,), model):
                    confirmed = seq
                    self._indexed.add(instance)
                    break
            if confirmed is None and version is not _UNVERSIONED:
                self._unconfirmed[instance] = (version, pending[-1][0])
            else:
                self._unconfirmed.pop(instance, None)
        if instance in self._indexed:
            before = now - self.config.prediction_catch_up
            self.prediction.settle(instance, before=before, upto_seq=confirmed)
            # A peer's prediction has no confirmation to wait for here: time settles it.
            self.peer.settle(instance, before=before)
        if pending is not None:
            live = self.prediction.first_seq(instance)
            while pending and (live is None or pending[0][0] < live):
                pending.popleft()
            if not pending:
                del self._pending[instance]

    def _sample(self, scored: list[Score], temperature: float) -> Score:
        costs = [s.cost for s in scored]
        lo, hi = min(costs), max(costs)
        span = (hi - lo) or 1.0
        weights = [math.exp(-((c - lo) / span) / temperature) for c in costs]
        return self.rng.choices(scored, weights=weights, k=1)[0]

    def on_routed(self, choice: Choice) -> None:
        instance = choice.worker.instance_id
        n = choice.prompt_blocks
        # A cached block is not free at a PD prefill: its KV still goes to the decode. An
        # aggregated worker sends nothing.
        send = self.config.send_weight * n if choice.worker.role == PREFILL else 0.0
        work = max(n - choice.matched_blocks + send, 1.0)
        self.work.add(instance, work)
        self.mean_work += (work - self.mean_work) * 0.05
        if not choice.hashes or choice.indexed_blocks >= n:
            return  # fully indexed there already: a prediction could only resurrect evictions
        seq = self.prediction.add(instance, choice.hashes)
        if self.share is not None:
            self.share(instance, choice.model, choice.hashes)
        if self.lookup is not None:
            # Watched for the index's confirmation, which also tells that the index follows
            # this instance at all (until then its predictions last the full TTL).
            pending = self._pending.get(instance)
            if pending is None:
                pending = self._pending[instance] = deque()
            if not pending or pending[-1][0] != seq:  # a repeat refreshes its entry
                pending.append((seq, choice.model, choice.hashes[-1]))

    def predicted_blocks(self) -> int:
        return len(self.prediction) + len(self.peer)

    def peer_routed(self, instance: str, model: str | None, hashes: Sequence[int]) -> None:
        """Another router routed a prompt with these block hashes to ``instance``."""
        if hashes:
            self.peer.add(instance, hashes)

    def forget(self, instance_id: str) -> None:
        self.prediction.forget(instance_id)
        self.peer.forget(instance_id)
        self.work.forget(instance_id)
        self._indexed.discard(instance_id)
        self._pending.pop(instance_id, None)
        self._unconfirmed.pop(instance_id, None)


def _candidates(scored: list[Score]) -> list[dict[str, Any]]:
    return [{"instance_id": s.worker.instance_id, "matched_blocks": s.matched,
             "index_blocks": s.indexed, "predicted_blocks": s.predicted,
             "index_tiers": s.tiers.as_dict() if s.tiers is not None else None,
             "credited_blocks": round(s.credited, 3), "load": s.load,
             "load_blocks": round(s.load_blocks, 3), "cost": s.cost}
            for s in sorted(scored, key=lambda s: (s.cost, s.load))]
