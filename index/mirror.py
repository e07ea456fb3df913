"""The read side of the etcd block index: an in-memory mirror kept by get-then-watch.

A ``BlockMirror`` reads every block segment of one model (or of all models) at one revision, then
watches from that revision + 1 and applies each segment's new content to a ``BlockTable`` (the
same structure the memory backend uses, so lookups cost the same): the blocks a put no longer
holds are removed, the new ones (or those on another medium) added. It keeps each segment's raw
value (about 9 bytes a block) to tell what changed; the writer never moves a held block between
segments (``index.segments``), so that is all the bookkeeping it takes. The loop itself, with its
resumes and reloads and its liveness, is ``index.follow.PrefixFollower``. Instance death needs
nothing special: etcd deletes the keys with the lease and the deletes arrive here as ordinary
watch events.

Keys under the blocks prefix that are not exactly what a writer produces (not UTF-8, a segment id
that is not 16 lowercase hex digits, an invalid instance id, extra path segments) are skipped
and counted in ``bad_keys``, values that are not a segment (``index.segments.decode`` refuses
them: a ``"n": true``, more than ``MAX_SEGMENT_BLOCKS`` blocks, lengths that disagree) in
``bad_values``, and a put of one empties that key's segment; both are counted by reason in
``skipped`` and logged once (``index.follow``): the prefix is shared, and another tool's key
must never stop the mirror. Anything unexpected while applying a batch is counted in ``errors``
and answered with a reload (with backoff), never by letting the task die. Caches (interned names,
per-model tables) are pruned when an instance or a model holds no blocks any more.

Lag is measured two ways: seconds between a writer's write time (the ``"t"`` of each segment)
and the moment the put is applied here, and revisions between etcd's head (learned from watch
progress notifications) and the last applied revision.

Block keys of the layout before segments (``/v1/blocks/``, one key per block) are not read: a
mirror that finds any says so once in its log and in ``stats()["legacy_blocks"]``, since they
mean a writer of an older kvatlas whose blocks no router sees.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from index.errors import MalformedKey
from index.etcd import EtcdClient
from index.follow import BAD_KEY, Entry, PrefixFollower
from index.keys import KeyLayout, validate_instance_id, validate_model
from index.reader import IndexReader, IndexStatus, InstanceDetail
from index.segments import MalformedSegment, Segment, decode
from index.table import BlockTable
from index.tiers import TierMatch
from index.writer import parse_hash_tail

logger = logging.getLogger(__name__)


@dataclass
class BlockMirrorConfig:
    """How a ``BlockMirror`` follows etcd."""

    progress_every: float = 1.0
    """Seconds between watch progress requests, which tell an idle mirror etcd's head revision
    (for ``revision_lag``)."""
    lag_samples: int = 8192
    """Recent per-put lag samples kept for the p50/p99 of ``lag_stats()``."""
    stale_after: float = 3.0
    """Seconds without a watch response or a successful quorum read after which ``connected``
    turns False (and a silent watch is answered with a reload). Must exceed ``progress_every``."""

    def __post_init__(self) -> None:
        if not 0.01 <= self.progress_every <= 60:
            raise ValueError(f"progress_every must be within [0.01, 60] s, got {self.progress_every}")
        if self.lag_samples < 1:
            raise ValueError(f"lag_samples must be >= 1, got {self.lag_samples}")
        if not self.progress_every < self.stale_after <= 600:
            raise ValueError(f"stale_after must be within (progress_every, 600] s, "
                             f"got {self.stale_after}")


class BlockMirror(PrefixFollower, IndexReader):
    """In-memory mirror of ``/blocks/{model}/`` (or of ``/blocks/`` when ``model`` is None).

    Readers outside index/ use the ``IndexReader`` methods (``match``, ``version``, ...); the
    attributes below are this class's own business."""

    kind = "blocks"

    def __init__(self, client: EtcdClient, layout: KeyLayout, model: str | None = None,
                 config: BlockMirrorConfig | None = None) -> None:
        self.model = validate_model(model) if model is not None else None
        self.config = config or BlockMirrorConfig()
        super().__init__(client, layout.blocks_prefix(model), f"block mirror {self.model}",
                         self.config.stale_after, self.config.progress_every)
        self.layout = layout
        self._root_len = len(layout.blocks_prefix())
        # A one-model mirror always has its model's table (empty until loaded).
        self.tables: dict[str, BlockTable] = {} if model is None else {self.model: BlockTable()}
        self._changed: dict[str, float] = {}
        """Per instance, when a change of its blocks was last applied (``InstanceDetail``)."""
        self._models: dict[bytes, str] = {}
        self._names: dict[bytes, str] = {}
        self._values: dict[bytes, bytes] = {}
        """The raw value of every segment applied, by key: what the next put changes."""
        self._lags: deque[float] = deque(maxlen=self.config.lag_samples)
        self.puts = 0
        """Segment puts applied."""
        self.deletes = 0
        self.legacy_blocks = 0
        """Keys found in the layout before segments (read by nobody): an older writer runs."""
        self._emptied = False

    @property
    def bad_keys(self) -> int:
        """Keys skipped: not a segment key as a writer writes it."""
        return self.skipped[BAD_KEY]

    @property
    def bad_values(self) -> int:
        """Values skipped: not a segment this version reads (by reason in ``skipped``)."""
        return sum(self.skipped.values()) - self.skipped[BAD_KEY]

    # --- reads ------------------------------------------------------------------------------

    def table(self, model: str | None = None) -> BlockTable:
        """The table of ``model`` (this mirror's model by default); read it, never write it."""
        name = model if model is not None else self.model
        if name is None:
            raise ValueError("this mirror follows every model: pass model=")
        # An unknown model reads as empty without being stored: asking must not grow the mirror.
        table = self.tables.get(name)
        return table if table is not None else BlockTable()

    def _writable(self, model: str) -> BlockTable:
        table = self.tables.get(model)
        if table is None:
            table = self.tables[model] = BlockTable()
        return table

    def lookup(self, hashes: Sequence[int], model: str | None = None) -> dict[str, int]:
        """``{instance: leading blocks of hashes held}`` as of ``revision``."""
        return self.table(model).lookup(hashes)

    def blocks(self, instance: str, model: str | None = None) -> set[int]:
        return self.table(model).blocks(instance)

    def instances(self, model: str | None = None) -> set[str]:
        return self.table(model).instances()

    # --- IndexReader ------------------------------------------------------------------------

    def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        table = self.tables.get(model)
        return table.lookup(hashes) if table is not None else {}

    def match_tiers(self, model: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        table = self.tables.get(model)
        return table.lookup_tiers(hashes) if table is not None else {}

    def version(self, model: str | None = None) -> Hashable:
        # Table versions are unique process-wide and a table never written is empty, so one
        # model's version is its table's, and the whole mirror's is the list of them.
        if model is None:
            if self.model is None:
                return tuple((name, t.version) for name, t in self.tables.items())
            model = self.model
        table = self.tables.get(model)
        return table.version if table is not None else 0

    def models(self) -> frozenset[str]:
        return frozenset(self.tables)

    def block_count(self, model: str | None = None) -> int:
        if model is None:
            return sum(len(t) for t in self.tables.values())
        table = self.tables.get(model)
        return len(table) if table is not None else 0

    def instance_ids(self) -> frozenset[str]:
        ids: set[str] = set()
        for t in self.tables.values():
            ids |= t.instances()
        return frozenset(ids)

    def instance(self, instance_id: str) -> InstanceDetail | None:
        blocks = {m: n for m, t in self.tables.items() if (n := t.count(instance_id))}
        if not blocks:
            return None
        return InstanceDetail(instance_id, blocks, self._changed.get(instance_id, 0.0))

    def status(self) -> IndexStatus:
        return IndexStatus(ready=self.ready, connected=self.connected,
                           blocks=self.block_count(), revision=self.revision,
                           revision_lag=self.revision_lag, disconnects=self.disconnects,
                           last_error=self.last_error)

    def lag_stats(self) -> dict[str, float]:
        """p50/p99/max of recent write-to-apply lags in seconds (needs synchronized clocks)."""
        if not self._lags:
            return {"samples": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        s = sorted(self._lags)
        n = len(s)
        return {"samples": n, "p50": s[n // 2], "p99": s[min(n - 1, (n * 99) // 100)],
                "max": s[-1]}

    def reset_lag(self) -> None:
        self._lags.clear()

    def stats(self) -> dict[str, object]:
        return {
            "model": self.model, **self.follow_stats(),
            "blocks": {m: len(t) for m, t in self.tables.items()},
            "segments": len(self._values), "puts": self.puts, "deletes": self.deletes,
            "bad_keys": self.bad_keys, "bad_values": self.bad_values,
            "legacy_blocks": self.legacy_blocks,
            "cached_names": len(self._names) + len(self._models),
            "lag_s": self.lag_stats(),
        }

    # --- the follower's hooks ---------------------------------------------------------------

    async def reload(self) -> None:
        # Once per snapshot, first (so that it is known when the mirror reads ready): is an
        # older writer still writing the layout before segments?
        old = await self.client.count_prefix(self.layout.legacy_blocks_prefix())
        if old and not self.legacy_blocks:
            logger.warning("%s: %d block keys under %s, the layout of kvatlas before block "
                           "segments, which nothing reads any more: upgrade the engines, index "
                           "agents and sidecars writing them", self.name, old,
                           self.layout.legacy_blocks_prefix().decode())
        self.legacy_blocks = old
        # Interned names start over (before the snapshot's keys are read into them): a reload
        # is when caches of the vanished can go.
        self._models, self._names = {}, {}
        await super().reload()

    def parse_key(self, key: bytes) -> tuple[str, str]:
        return self._parse(key)

    def decode(self, name: tuple[str, str], value: bytes) -> Segment:
        return decode(value)

    def load(self, revision: int, entries: list[Entry]) -> None:
        values: dict[bytes, bytes] = {}
        groups: dict[tuple[str, str, str], list[int]] = {}
        for e in entries:
            model, instance = e.name
            values[e.key] = e.value
            for medium, hashes in e.data.by_medium().items():
                groups.setdefault((model, instance, medium), []).extend(hashes)
        tables: dict[str, BlockTable] = {}
        for (model, instance, medium), hashes in groups.items():
            table = tables.get(model)
            if table is None:
                table = tables[model] = BlockTable()
            table.apply_add(instance, hashes, medium)
        if self.model is not None:
            tables.setdefault(self.model, BlockTable())
        now = time.time()
        changed = {instance: now for t in tables.values() for instance in t.instances()}
        # Swap at once: lookups see either the old or the new state, never a half-built one.
        self.tables, self._changed, self._values = tables, changed, values

    def apply(self, entries: list[Entry]) -> None:
        applied_at = time.time()
        stamps: list[float] = []
        for e in entries:
            model, instance = e.name
            old_raw = self._values.pop(e.key, None)
            new: Segment | None = e.data  # None: a delete, or a put of a value that is no segment
            if new is not None:
                self._values[e.key] = e.value
                stamps.append(new.t)
                self.puts += 1
            else:
                self.deletes += 1
            # Only values that decoded are kept: this one decodes again.
            old = decode(old_raw) if old_raw is not None else None
            self._apply_segment(model, instance, old, new, applied_at)
        if stamps:
            now = time.time()
            self._lags.extend(now - t for t in stamps)
        if self._emptied:
            self._prune()

    # --- applying watch events --------------------------------------------------------------

    def _apply_segment(self, model: str, instance: str, old: Segment | None,
                       new: Segment | None, applied_at: float) -> None:
        """Make the table hold ``new`` where it held ``old`` (None: nothing)."""
        was = dict(zip(old.hashes, old.media, strict=True)) if old is not None else {}
        added: dict[str, list[int]] = {}
        if new is not None and not was:
            added = new.by_medium()  # a new segment: every block of it is added
        elif new is not None:
            for h, m in zip(new.hashes, new.media, strict=True):
                if was.pop(h, None) != m:
                    added.setdefault(m, []).append(h)
        # What is left of ``was`` is no longer in the segment.
        if was:
            # A delete in a model never seen removes nothing: it must not create a table (an
            # empty one would count as a model in ``models()`` until the next prune).
            table = self.tables.get(model)
            if table is not None:
                table.apply_remove(instance, was)
                if not table.count(instance):
                    self._emptied = True
        if added:
            table = self._writable(model)
            for medium, hashes in added.items():
                table.apply_add(instance, hashes, medium)
        if was or added:
            self._changed[instance] = applied_at

    def _prune(self) -> None:
        """Forget caches of instances and models that hold no blocks any more."""
        self._emptied = False
        for name in [m for m, t in self.tables.items() if not len(t) and m != self.model]:
            del self.tables[name]
        live: set[str] = set()
        for t in self.tables.values():
            live |= t.instances()
        self._names = {raw: n for raw, n in self._names.items() if n in live}
        self._changed = {i: t for i, t in self._changed.items() if i in live}
        self._models = {raw: m for raw, m in self._models.items() if m in self.tables}

    def _parse(self, key: bytes) -> tuple[str, str]:
        """(model, instance) of a writer's segment key; MalformedKey for anything else. (Not
        ``KeyLayout.parse_segment``: interned names make this cheap for the millions of keys of
        a large snapshot.)"""
        parts = key[self._root_len:].split(b"/")
        if len(parts) != 3 or parse_hash_tail(parts[2]) is None:
            raise MalformedKey(key, "not a block segment key: want {model}/{instance}/{segment}")
        raw_model, raw_instance, _ = parts
        model = self._models.get(raw_model)
        if model is None:
            model = self._intern_model(raw_model)
            if model is None:
                raise MalformedKey(key, "a model name not as KeyLayout quotes one")
        instance = self._names.get(raw_instance)
        if instance is None:
            try:
                instance = validate_instance_id(raw_instance.decode())
            except ValueError as exc:  # UnicodeDecodeError included
                raise MalformedKey(key, f"bad instance id: {exc}") from None
            self._names[raw_instance] = instance
        return model, instance

    def _intern_model(self, raw: bytes) -> str | None:
        try:
            model = validate_model(unquote(raw.decode(), errors="strict"))
        except ValueError:  # UnicodeDecodeError included
            return None
        if quote(model, safe="").encode() != raw:
            return None  # not how KeyLayout writes it: "%41" and "A" must not both be model "A"
        self._models[raw] = model
        return model


def write_time(value: bytes) -> float | None:
    """When a segment value was written (its header's ``t``); None for a value that is not one."""
    try:
        return decode(value).t
    except MalformedSegment:
        return None
