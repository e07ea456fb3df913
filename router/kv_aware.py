"""The kv_aware prefill policy: longest cached prefix (etcd mirror + own predictions) vs load.

cost(instance) = (prompt blocks - blocks it already holds) x overlap_weight + in-flight requests.
Lowest cost wins; equal costs go to the less loaded instance, then at random. With a temperature,
the choice is sampled from a softmax over the normalized costs instead (Dynamo's scheme).

Router-side prediction: the blocks of a routed prompt count as held by the chosen instance for
``prediction_ttl`` seconds, so a burst of same-prefix requests sticks to one instance before the
engine's KV events have made the round trip through etcd. The predictions live in a ``BlockTable``
(the index's own structure, same lookup cost) with a bounded number of entries.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence

from index.hashing import namespace_seed
from index.table import BlockTable
from router.config import RouterConfig
from router.policy import Choice, Policy, RouteContext
from router.workers import Worker

Lookup = Callable[[Sequence[int], "str | None"], dict[str, int]]


class Prediction:
    """Blocks recently routed to each instance, forgotten after ``ttl`` seconds.

    Layout chosen for the garbage collector: per-instance ``{hash: expiry}`` dicts and queue
    entries of tuples of ints hold only atomic values, so CPython stops tracking them and a full
    collection does not walk hundreds of thousands of small objects (a latency spike per GC).
    """

    def __init__(self, ttl: float = 120.0, max_blocks: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._clock = clock
        self.table = BlockTable()
        self._expiry: dict[str, dict[int, float]] = {}
        self._count = 0
        self._queue: deque[tuple[float, str, tuple[int, ...]]] = deque()

    def __len__(self) -> int:
        return self._count

    def add(self, instance: str, hashes: Sequence[int]) -> None:
        if not hashes:
            return
        now = self._clock()
        self.expire(now)
        until = now + self.ttl
        self.table.apply_add(instance, hashes)
        expiry = self._expiry.get(instance)
        if expiry is None:
            expiry = self._expiry[instance] = {}
        before = len(expiry)
        expiry.update(dict.fromkeys(hashes, until))
        self._count += len(expiry) - before
        self._queue.append((until, instance, tuple(hashes)))
        while self._count > self.max_blocks and self._queue:
            self._drop(self._queue.popleft())

    def expire(self, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        queue = self._queue
        while queue and queue[0][0] <= now:
            self._drop(queue.popleft())

    def _drop(self, entry: tuple[float, str, tuple[int, ...]]) -> None:
        until, instance, hashes = entry
        expiry = self._expiry.get(instance)
        if expiry is None:
            return
        gone = []
        for h in hashes:
            e = expiry.get(h)
            # A later add refreshed this block: its own queue entry will drop it.
            if e is not None and e <= until:
                del expiry[h]
                gone.append(h)
        if gone:
            self._count -= len(gone)
            self.table.apply_remove(instance, gone)
        if not expiry:
            del self._expiry[instance]

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        self.expire()
        return self.table.lookup(hashes)

    def forget(self, instance: str) -> None:
        self.table.clear_instance(instance)
        self._count -= len(self._expiry.pop(instance, {}))


class KvAware(Policy):
    name = "kv_aware"

    def __init__(self, config: RouterConfig, lookup: Lookup | None = None,
                 rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(rng)
        self.config = config
        self.lookup = lookup
        self.seed = namespace_seed()
        self.prediction = Prediction(config.prediction_ttl, config.prediction_max_blocks, clock)

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        cfg = self.config
        hashes = ctx.hashes(cfg.block_size, self.seed)
        n = len(hashes)
        indexed = self.lookup(hashes, ctx.model) if (self.lookup and n) else {}
        predicted = self.prediction.lookup(hashes) if n else {}
        weight = cfg.overlap_weight
        scored = []
        for w in workers:
            m = max(indexed.get(w.instance_id, 0), predicted.get(w.instance_id, 0))
            scored.append((float((n - m) * weight + w.load), w.load, m, w))
        if cfg.temperature > 0 and len(scored) > 1:
            pick = self._sample(scored, cfg.temperature)
        else:
            best = min((c, load) for c, load, _, _ in scored)
            pick = self.rng.choice([s for s in scored if (s[0], s[1]) == best])
        candidates = [{"instance_id": w.instance_id, "matched_blocks": m, "load": load,
                       "cost": c} for c, load, m, w in sorted(scored, key=lambda s: (s[0], s[1]))]
        return Choice(pick[3], candidates, matched_blocks=pick[2], prompt_blocks=n,
                      hashes=hashes)

    def _sample(self, scored: list, temperature: float) -> tuple:
        costs = [s[0] for s in scored]
        lo, hi = min(costs), max(costs)
        span = (hi - lo) or 1.0
        weights = [math.exp(-((c - lo) / span) / temperature) for c in costs]
        return self.rng.choices(scored, weights=weights, k=1)[0]

    def on_routed(self, choice: Choice) -> None:
        self.prediction.add(choice.worker.instance_id, choice.hashes)

    def forget(self, instance_id: str) -> None:
        self.prediction.forget(instance_id)
