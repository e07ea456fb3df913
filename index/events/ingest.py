"""Per-instance KV-event ingestion: decoded batches in, ``BlockIndex`` writes out. No I/O here.

Engine hashes are never used as keys. For each BlockStored we recompute kvatlas's own chained
hashes from ``token_ids``, chained from the *own* hash of the parent (found through a per-instance
map engine hash -> own hash), and keep that map so BlockRemoved can be translated. The map is
bounded: entries leave on BlockRemoved and clears, and past ``max_engine_hashes`` the oldest
entries are evicted *and removed from the index*, so the index never claims a block we could no
longer retract.

Media: vLLM's CPU offloading stores the same engine hash on ``GPU`` and ``CPU`` and removes each
copy separately. Per block we track the set of media holding it (only for blocks not on the GPU
alone, so the common case costs nothing); the index gets the best one (GPU first), a removal
naming one medium only re-keys the block to what is left, and a removal naming none drops all.

Sequence numbers (one publisher = one counter from 0):
- ``seq == last + 1``: apply;
- gap: with a replay endpoint, ask for replay from ``last + 1`` (``ReplayRequest``) and apply the
  replayed batches; without one (or when replay cannot fill the gap) clear the instance and mark
  it ``resyncing``: its earlier blocks are unknown, and blocks chained to them will be refused as
  ``unknown_parent`` until the engine's cache turns over;
- backwards (and not a replay duplicate): the engine restarted, its cache is empty: clear, and
  the new process's numbers start a new sequence (a gap in it is replayed from its own start);
- a duplicate is a live copy of a batch a replay already delivered: within the replayed range
  *and* with the same publisher timestamp. A restarted engine's batch can carry a replayed number
  (its first batches lost to the slow joiner) but never its timestamp, so it is a restart;
- batches that arrive during a replay are held back and then sequenced as the live batches they
  are (a restart among them is noticed), only without a second replay round;
- ``AllBlocksCleared``: clear; the index is complete again, so ``resyncing`` ends.

Namespaces (what makes two equal token runs different blocks):
- ``lora_name`` given: the blocks are hashed in that LoRA's namespace
  (``namespace_seed(lora_name, None)``), so a base-model prompt never matches adapter blocks;
- ``lora_id`` set without ``lora_name``: refused (``lora_without_name``): an id is local to one
  engine and the hash contract names adapters, so we cannot tell which namespace it is;
- ``extra_keys`` non-empty for any block (multimodal content hashes, cache salts, tenant keys):
  refused (``extra_keys``): the hash contract covers tokens and LoRA/salt namespaces only, and
  indexing such blocks by their tokens would claim prefix hits across images or tenants.

Each event is applied on its own: a refused event (counted by reason in ``stats.rejected``,
e.g. ``bad_medium`` for a medium the index cannot store) or an index write that raises
(``index_error``) never stops the batch, and the batch's sequence number is recorded anyway, so
one odd event is never mistaken for lost events (which would clear the whole instance).
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal

from index.block_index import GPU, BlockIndex, BlockSink, valid_medium
from index.events.pacing import TimeSlice
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from index.hashing import DEFAULT_BLOCK_SIZE, block_hashes, namespace_seed

logger = logging.getLogger(__name__)

State = Literal["synced", "replaying", "resyncing"]
_GPU_ONLY = frozenset((GPU,))


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """Ask the publisher's replay ROUTER for every batch from ``start_seq`` on."""

    start_seq: int


@dataclass
class IngestStats:
    batches: int = 0
    """Batches applied (replayed ones included, duplicates not)."""
    applied: int = 0
    """Events applied."""
    rejected: Counter[str] = field(default_factory=Counter)
    """Events refused, by reason: block_size_mismatch, unknown_parent, token_count_mismatch, ..."""
    last_seq: int | None = None
    gaps: int = 0
    dropped: int = 0
    """Batches that never arrived in order: the sequence numbers each gap skipped (dropped by
    ZMQ past a high-water mark under a flood, lost to the slow joiner, or held back past
    ``max_held_back`` during a replay). A replay recovers them while the publisher still keeps
    them; otherwise the instance was cleared and is resyncing."""
    replays: int = 0
    replay_failures: int = 0
    restarts: int = 0
    clears: int = 0
    duplicates: int = 0
    unknown_removed: int = 0
    evicted: int = 0
    index_errors: int = 0
    """Index writes that raised (the event is counted as rejected ``index_error``)."""

    def as_dict(self) -> dict[str, object]:
        return {"batches": self.batches, "applied": self.applied, "rejected": dict(self.rejected),
                "last_seq": self.last_seq, "gaps": self.gaps, "dropped": self.dropped,
                "replays": self.replays,
                "replay_failures": self.replay_failures, "restarts": self.restarts,
                "clears": self.clears, "duplicates": self.duplicates,
                "unknown_removed": self.unknown_removed, "evicted": self.evicted,
                "index_errors": self.index_errors}


class InstanceIngestor:
    """Applies one engine's KV-event batches, in sequence order, to ``index`` under ``instance``."""

    def __init__(self, index: BlockIndex | BlockSink, instance: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
                 replay: bool = False, max_engine_hashes: int = 4_000_000,
                 max_held_back: int = 10_000) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_engine_hashes < 1:
            raise ValueError(f"max_engine_hashes must be >= 1, got {max_engine_hashes}")
        self.index = index
        self.instance = instance
        # A BlockSink (this instance's writer, a DP union's view) is written synchronously; a
        # shared BlockIndex (several instances, e.g. an in-process one) is awaited.
        self._sink = None if isinstance(index, BlockIndex) else index
        self.block_size = block_size
        self.replay = replay
        self.max_engine_hashes = max_engine_hashes
        self.stats = IngestStats()
        self._state: State = "synced"
        self._replaying = False
        # engine hash -> own hash, in store order (oldest first) for eviction at the cap.
        self._own: dict[int, int] = {}
        # Only for blocks not held on the GPU alone (offloaded copies, CPU-only blocks):
        # engine hash -> (media holding it, own parent hash, kept to re-key it on a partial removal).
        self._media: dict[int, tuple[frozenset[str], int | None]] = {}
        self._seeds: dict[str | None, int] = {None: namespace_seed()}
        self._trigger: tuple[int, KVEventBatch] | None = None
        self._held_back: deque[tuple[int, KVEventBatch]] = deque(maxlen=max_held_back)
        self._dup_range: tuple[int, int] | None = None
        # seq -> publisher timestamp of batches applied since a replay began, while live copies
        # of them may still arrive (at most a replay's worth: the publisher keeps 10,000).
        self._replayed_ts: dict[int, float] = {}
        # One batch may hold 65,536 events (DecodeLimits): seconds of work on its own.
        self._slice = TimeSlice()

    @property
    def state(self) -> State:
        """``synced``, ``replaying`` (a gap is being filled) or ``resyncing`` (events were lost)."""
        return "replaying" if self._replaying else self._state

    @property
    def engine_hashes(self) -> int:
        return len(self._own)

    # -- sequencing ------------------------------------------------------------------------

    async def on_batch(self, seq: int, batch: KVEventBatch, *,
                       replayed: bool = False) -> ReplayRequest | None:
        """Feed one batch; returns a ``ReplayRequest`` when the caller should replay a gap."""
        if self._replaying and not replayed:
            # Live traffic that overtakes a replay waits (bounded) until the replay ends.
            self._held_back.append((seq, batch))
            return None
        return await self._sequence(seq, batch, replayed=replayed)

    async def _sequence(self, seq: int, batch: KVEventBatch, *, replayed: bool,
                        held: bool = False) -> ReplayRequest | None:
        live = not replayed and not held
        if live and self._dup_range is not None and seq > self._dup_range[1]:
            self._end_duplicates()  # live traffic is past everything the replay delivered
        last = self.stats.last_seq
        if last is not None and seq <= last:
            if replayed or self._is_duplicate(seq, batch):
                self.stats.duplicates += 1
                return None
            logger.info("instance %s: sequence went back from %d to %d; engine restarted, clearing",
                     self.instance, last, seq)
            self.stats.restarts += 1
            await self._reset()
            self._state = "synced"
            self._end_duplicates()
            # The old process's numbers are over: a replay must start from the new one's 0.
            self.stats.last_seq = last = None
        expected = 0 if last is None else last + 1
        if seq != expected:
            self.stats.gaps += 1
            self.stats.dropped += seq - expected
            if self.replay and live:
                logger.info("instance %s: gap (expected seq %d, got %d); replaying",
                         self.instance, expected, seq)
                self._replaying = True
                self.stats.replays += 1
                self._trigger = (seq, batch)
                return ReplayRequest(expected)
            logger.warning("instance %s: lost KV events %d..%d; clearing and resyncing",
                        self.instance, expected, seq - 1)
            await self._reset()
            self._state = "resyncing"
        await self._apply(seq, batch)
        if self._replaying or self._dup_range is not None:
            self._replayed_ts[seq] = batch.ts
        return None

    def _is_duplicate(self, seq: int, batch: KVEventBatch) -> bool:
        return (self._dup_range is not None and self._dup_range[0] <= seq <= self._dup_range[1]
                and self._replayed_ts.get(seq) == batch.ts)

    def _end_duplicates(self) -> None:
        self._dup_range = None
        self._replayed_ts.clear()

    async def replay_finished(self, ok: bool) -> None:
        """The replay stream ended (``ok``: end marker seen) or failed (timeout, no ROUTER)."""
        if not self._replaying or self._trigger is None:
            return
        trig_seq, trig_batch = self._trigger
        self._trigger = None
        self._replaying = False
        last = self.stats.last_seq
        if ok and last is not None and last >= trig_seq:
            self._dup_range = (trig_seq, last)
        else:
            self.stats.replay_failures += 1
            logger.warning("instance %s: replay did not reach seq %d; clearing and resyncing",
                        self.instance, trig_seq)
            await self._reset()
            self._state = "resyncing"
            self._end_duplicates()
            await self._apply(trig_seq, trig_batch)
        held = list(self._held_back)
        self._held_back.clear()
        for seq, batch in held:
            # A second gap among held-back batches is handled without another replay round.
            await self._sequence(seq, batch, replayed=False, held=True)
        if self._dup_range is not None and self.stats.last_seq is not None:
            # Live copies of everything applied so far may still be queued in the SUB socket.
            self._dup_range = (self._dup_range[0], self.stats.last_seq)

    async def _add(self, parent: int | None, hashes: list[int], medium: str) -> None:
        if self._sink is not None:
            self._sink.add(parent, hashes, medium)
        else:
            await self.index.add(self.instance, parent, hashes, medium)  # type: ignore[union-attr]

    async def _remove(self, hashes: list[int]) -> None:
        if self._sink is not None:
            self._sink.remove(hashes)
        else:
            await self.index.remove(self.instance, hashes)  # type: ignore[union-attr]

    async def _clear(self) -> None:
        if self._sink is not None:
            self._sink.clear()
        else:
            await self.index.clear(self.instance)  # type: ignore[union-attr]

    async def _reset(self) -> None:
        self._own.clear()
        self._media.clear()
        self.stats.clears += 1
        try:
            await self._clear()
        except Exception:
            self.stats.index_errors += 1
            logger.exception("instance %s: clearing the index failed", self.instance)

    # -- events ----------------------------------------------------------------------------

    async def _apply(self, seq: int, batch: KVEventBatch) -> None:
        for ev in batch.events:
            try:
                if isinstance(ev, BlockStored):
                    reason = await self._stored(ev)
                elif isinstance(ev, BlockRemoved):
                    reason = await self._removed(ev)
                elif isinstance(ev, AllBlocksCleared):
                    await self._reset()
                    self._state = "synced"  # the engine's cache is empty: we know all of it again
                    reason = None
                else:  # pragma: no cover - the codec only produces the three types
                    reason = "unknown_event"
            except Exception:
                # One event the index cannot take must not look like lost events: count it and
                # go on, so the sequence number still advances.
                self.stats.index_errors += 1
                logger.exception("instance %s: applying %s of seq %d failed", self.instance,
                              type(ev).__name__, seq)
                reason = "index_error"
            if reason is None:
                self.stats.applied += 1
            else:
                self.stats.rejected[reason] += 1
            # Safe mid-batch: each event's index writes are done, and batches of one ingestor
            # are fed one at a time (the caller awaits this one before the next).
            await self._slice.tick()
        self.stats.batches += 1
        self.stats.last_seq = seq

    def _seed(self, lora_name: str | None) -> int:
        seed = self._seeds.get(lora_name)
        if seed is None:
            if len(self._seeds) > 4096:  # LoRA names come from the wire: keep the cache bounded
                self._seeds = {None: self._seeds[None]}
            seed = self._seeds[lora_name] = namespace_seed(lora_name)
        return seed

    async def _stored(self, ev: BlockStored) -> str | None:
        if ev.block_size != self.block_size:
            return "block_size_mismatch"
        n = len(ev.block_hashes)
        if n == 0:
            return "empty"
        if len(ev.token_ids) != n * self.block_size:
            return "token_count_mismatch"
        if ev.lora_id is not None and ev.lora_name is None:
            return "lora_without_name"
        if ev.has_extra_keys:
            return "extra_keys"
        if ev.medium is not None and not valid_medium(ev.medium):
            return "bad_medium"
        own_parent: int | None = None
        if ev.parent_block_hash is not None:
            own_parent = self._own.get(ev.parent_block_hash)
            if own_parent is None:
                return "unknown_parent"
        try:
            own = block_hashes(ev.token_ids, self.block_size, self._seed(ev.lora_name), own_parent)
        except ValueError:
            return "bad_tokens"
        table = self._own
        media_of = self._media
        medium = ev.medium or GPU
        stale: list[int] = []
        runs: list[tuple[str, int | None, list[int]]] = []  # (best medium, parent, hashes)
        prev_own = own_parent
        for e, o in zip(ev.block_hashes, own):
            old = table.pop(e, None)  # re-stored blocks move to the young end
            table[e] = o
            if old == o and e in media_of:
                media = media_of[e][0] | {medium}
            elif old == o:
                media = _GPU_ONLY | {medium}
            else:
                if old is not None:
                    stale.append(old)  # same engine hash, other tokens: the old key is gone
                media = frozenset((medium,))
            if media == _GPU_ONLY:
                media_of.pop(e, None)
            else:
                media_of[e] = (media, prev_own)
            best = _best(media)
            if runs and runs[-1][0] == best:
                runs[-1][2].append(o)
            else:
                runs.append((best, prev_own, [o]))
            prev_own = o
        if stale:
            await self._remove(stale)
        for best, parent, hashes in runs:
            await self._add(parent, hashes, best)
        if len(table) > self.max_engine_hashes:
            await self._evict(len(table) - self.max_engine_hashes)
        return None

    async def _evict(self, n: int) -> None:
        table = self._own
        victims = []
        it = iter(table)
        for _ in range(n):
            victims.append(next(it))
        owns = []
        for e in victims:
            owns.append(table.pop(e))
            self._media.pop(e, None)
        self.stats.evicted += len(owns)
        await self._remove(owns)

    async def _removed(self, ev: BlockRemoved) -> str | None:
        """Drop the medium the event names (all media when it names none); a block leaves the
        index only when no medium holds it any more, else it is re-keyed to the best one left."""
        table = self._own
        media_of = self._media
        gone: list[int] = []
        moved: list[tuple[str, int | None, int]] = []
        unknown = 0
        for e in ev.block_hashes:
            o = table.get(e)
            if o is None:
                unknown += 1
                continue
            entry = media_of.get(e)
            media = entry[0] if entry is not None else _GPU_ONLY
            if ev.medium is None:
                rest: frozenset[str] = frozenset()
            elif ev.medium not in media:
                unknown += 1
                continue
            else:
                rest = media - {ev.medium}
            if not rest:
                del table[e]
                media_of.pop(e, None)
                gone.append(o)
                continue
            parent = entry[1] if entry is not None else None
            if rest == _GPU_ONLY:
                del media_of[e]
            else:
                media_of[e] = (rest, parent)
            if _best(rest) != _best(media):
                moved.append((_best(rest), parent, o))
        self.stats.unknown_removed += unknown
        if gone:
            await self._remove(gone)
        for medium, parent, o in moved:
            await self._add(parent, [o], medium)
        return None


def _best(media: frozenset[str]) -> str:
    """The medium a router cares about most: GPU if the block is there, else a stable choice."""
    return GPU if GPU in media else min(media)
