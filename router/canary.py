"""Canaries: does the block index show what a prefill just served?

An instance can publish KV events that the index takes and that still never match the
router's hashes (another tokenizer, chat template, block size or namespace than its record
says; a sidecar that rewrites ids; events dropped on the way). Nothing fails then: kv_aware
just never sees a prefix there. So, after a request was served by prefill P, the router keeps
the first ``CANARY_BLOCKS`` block hashes of its prompt (the very hashes it routed on) and, when
``canary_delay`` seconds have passed (time for the engine's events to reach etcd and the
router's mirror), asks the index whether P holds the first of them: a *hit*; if not, it looks
once more ``canary_delay`` later (a busy moment can delay the index), and only then counts a
*miss*.
Consecutive misses on an instance that serves requests are the sign ``kvatlas doctor`` reads
(``GET /debug/index_health``).

Cheap by design: at most one canary per instance per ``canary_interval`` seconds and
``MAX_PENDING`` waiting per instance; only for etcd instances (a static worker's id is in no
index: its canaries could only miss) whose index entries the guards use
(router/index_guards.py); none without an index, and those due while the index is not live
(loading, or etcd away) are dropped rather than judged on a stale mirror.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from index.hashing import BASE_SEED, block_hashes
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.workers import COMPUTE_ROLES, ETCD, Worker

logger = logging.getLogger(__name__)

CANARY_BLOCKS = 8
"""Leading block hashes a canary keeps (the index is asked for the longest prefix of them)."""
MAX_PENDING = 4
"""Canaries waiting per instance; past it none is taken until one was checked."""
CHECK_EVERY = 0.5
"""Seconds between two looks at the due canaries."""
HIT, MISS = "hit", "miss"


@dataclass(frozen=True)
class Canary:
    model: str | None
    hashes: tuple[int, ...]
    due: float
    """Monotonic time at which it is checked."""
    second: bool = False
    """Checked once already and not found: one more look before it counts as a miss (an index
    that lags a busy moment is not a mismatch)."""


@dataclass
class CanaryStats:
    """One instance's served requests and canary results."""

    requests_with_blocks: int = 0
    """Requests it served whose prompt had at least one full block."""
    hits: int = 0
    misses: int = 0
    consecutive_misses: int = 0
    last_checked: float | None = None
    """Unix time of the last check (None: never checked)."""
    last_taken: float | None = None
    """Monotonic time the last canary was taken."""
    pending: deque[Canary] = field(default_factory=deque)

    def describe(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses,
                "consecutive_misses": self.consecutive_misses,
                "last_checked": self.last_checked}


EMPTY = CanaryStats()


class Canaries:
    """Per prefill instance: canaries taken after served requests, checked once due."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 lookup: Callable[[Sequence[int], str | None], dict[str, int]],
                 live: Callable[[], bool], ignored: Callable[[str], bool] = lambda iid: False,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.metrics = metrics
        self.lookup = lookup
        """The index's match for a request's model, *unfiltered* by the guards."""
        self.live = live
        """True while there is an index and it is loaded and current."""
        self.ignored = ignored
        self._clock = clock
        self._wall = wall
        self._stats: dict[str, CanaryStats] = {}

    def stats(self, instance_id: str) -> CanaryStats:
        """``instance_id``'s counters (all zero for one that served nothing yet)."""
        return self._stats.get(instance_id, EMPTY)

    def served(self, worker: Worker, tokens: Sequence[int], model: str | None,
               hashes: Sequence[int] = ()) -> None:
        """Prefill ``worker`` served a prompt of ``tokens`` (``hashes``: its block hashes in
        the base namespace when the policy made them, else they are made here if needed)."""
        bs = self.config.block_size
        if (worker.role not in COMPUTE_ROLES and not worker.local_prefill) or len(tokens) < bs:
            return
        iid = worker.instance_id
        st = self._stats.get(iid)
        if st is None:
            st = self._stats[iid] = CanaryStats()
        st.requests_with_blocks += 1
        now = self._clock()
        if (worker.source != ETCD or len(st.pending) >= MAX_PENDING
                or (st.last_taken is not None
                    and now - st.last_taken < self.config.canary_interval)
                or self.ignored(iid) or not self.live()):
            return
        head = (tuple(hashes[:CANARY_BLOCKS]) if hashes
                else tuple(block_hashes(tokens[:CANARY_BLOCKS * bs], bs, BASE_SEED)))
        st.last_taken = now
        st.pending.append(Canary(model, head, now + self.config.canary_delay))

    def check(self) -> int:
        """Check the canaries that are due; returns how many were judged."""
        now = self._clock()
        judged = 0
        m = self.metrics
        for iid, st in self._stats.items():
            pending = st.pending
            while pending and pending[0].due <= now:
                canary = pending.popleft()
                if self.ignored(iid) or not self.live():
                    continue  # not a fact about its events: its entries are not used, or stale
                hit = self.lookup(canary.hashes, canary.model).get(iid, 0) > 0
                if not hit and not canary.second:
                    pending.append(Canary(canary.model, canary.hashes,
                                          now + self.config.canary_delay, second=True))
                    continue
                st.last_checked = self._wall()
                judged += 1
                if hit:
                    st.hits += 1
                    st.consecutive_misses = 0
                else:
                    st.misses += 1
                    st.consecutive_misses += 1
                    logger.debug("canary of instance %s missed (%d in a row): the index holds "
                                 "no block of a prompt it served %.1f s ago", iid,
                                 st.consecutive_misses, 2 * self.config.canary_delay)
                m.child(m.canary, iid, HIT if hit else MISS).inc()
        return judged

    async def run(self) -> None:
        """Check every ``CHECK_EVERY`` seconds until cancelled."""
        while True:
            await asyncio.sleep(CHECK_EVERY)
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a bad check must not end the checks
                logger.exception("canary check failed")

    def on_worker(self, event: str, worker: Worker) -> None:
        """Pools listener: a departed instance's canaries and series go; a moved one's
        pending canaries were served by another server."""
        iid = worker.instance_id
        if event == "leave":
            if self._stats.pop(iid, None) is not None:
                for result in (HIT, MISS):
                    self.metrics.drop(self.metrics.canary, iid, result)
        elif event == "moved":
            st = self._stats.get(iid)
            if st is not None:
                st.pending.clear()
