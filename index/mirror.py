"""The read side of the etcd block index: an in-memory mirror kept by get-then-watch.

A ``BlockMirror`` reads every block key of one model (or of all models) at one revision, then
watches from that revision + 1 and applies each put/delete to a ``BlockTable`` (the same structure
the memory backend uses, so lookups cost the same). The loop itself, with its resumes and reloads
and its liveness, is ``index.follow.PrefixFollower``. Instance death needs nothing special: etcd
deletes the keys with the lease and the deletes arrive here as ordinary watch events.

Keys under the blocks prefix that are not exactly what a writer produces (not UTF-8, a hash that
is not 16 lowercase hex digits, an invalid instance id, extra path segments) are counted in
``bad_keys`` and skipped: the prefix is shared, and another tool's key must never stop the mirror.
Anything unexpected while applying a batch is counted in ``errors`` and answered with a reload
(with backoff), never by letting the task die. Caches (interned names, per-model tables) are
pruned when an instance or a model holds no blocks any more.

Lag is measured two ways: seconds between a writer's write time (the ``"t"`` field of each value)
and the moment the put is applied here, and revisions between etcd's head (learned from watch
progress notifications) and the last applied revision.
"""
from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from index.etcd import EtcdClient, KeyValue, WatchEvent
from index.follow import PrefixFollower
from index.keys import KeyLayout, validate_instance_id, validate_model
from index.reader import IndexReader, IndexStatus, InstanceDetail
from index.table import GPU, BlockTable
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
        self._media: dict[bytes, str] = {}
        self._lags: deque[float] = deque(maxlen=self.config.lag_samples)
        self.puts = 0
        self.deletes = 0
        self.bad_keys = 0
        self._emptied = False

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
            "puts": self.puts, "deletes": self.deletes, "bad_keys": self.bad_keys,
            "cached_names": len(self._names) + len(self._models),
            "lag_s": self.lag_stats(),
        }

    # --- the follower's hooks ---------------------------------------------------------------

    def load(self, revision: int, kvs: list[KeyValue]) -> None:
        # Interned names start over: a reload is when caches of the vanished can go.
        self._models, self._names, self._media = {}, {}, {}
        groups: dict[tuple[str, str, str], list[int]] = {}
        for kv in kvs:
            parsed = self._parse(kv.key)
            if parsed is None:
                continue
            model, instance, h = parsed
            groups.setdefault((model, instance, self._medium(kv.value)), []).append(h)
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
        self.tables, self._changed = tables, changed

    def apply(self, events: list[WatchEvent]) -> None:
        self._apply(events)
        if self._emptied:
            self._prune()

    # --- applying watch events --------------------------------------------------------------

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

    def _apply(self, events: list[WatchEvent]) -> None:
        # Consecutive events of one kind for one instance are applied as one table call.
        run_key: tuple[bool, str, str, str] | None = None
        run: list[int] = []
        stamps: list[float] = []
        applied_at = time.time()
        for ev in events:
            parsed = self._parse(ev.key)
            if parsed is None:
                continue
            model, instance, h = parsed
            if ev.put:
                medium = self._medium(ev.value)
                t = write_time(ev.value)
                if t is not None:
                    stamps.append(t)
            else:
                medium = GPU
            key = (ev.put, model, instance, medium)
            if key != run_key:
                self._flush_run(run_key, run, applied_at)
                run_key, run = key, []
            run.append(h)
        self._flush_run(run_key, run, applied_at)
        if stamps:
            now = time.time()
            self._lags.extend(now - t for t in stamps)

    def _flush_run(self, key: tuple[bool, str, str, str] | None, hashes: list[int],
                   applied_at: float) -> None:
        if key is None or not hashes:
            return
        put, model, instance, medium = key
        if put:
            self.puts += len(hashes)
            self._writable(model).apply_add(instance, hashes, medium)
            self._changed[instance] = applied_at
        else:
            self.deletes += len(hashes)
            # A delete in a model never seen removes nothing: it must not create a table (an
            # empty one would count as a model in ``models()`` until the next prune).
            table = self.tables.get(model)
            if table is None:
                return
            table.apply_remove(instance, hashes)
            self._changed[instance] = applied_at
            if not table.count(instance):
                self._emptied = True

    def _parse(self, key: bytes) -> tuple[str, str, int] | None:
        """(model, instance, hash) of a writer's block key; None (counted) for anything else."""
        parts = key[self._root_len:].split(b"/")
        h = parse_hash_tail(parts[2]) if len(parts) == 3 else None
        if h is None:
            self.bad_keys += 1
            return None
        raw_model, raw_instance, _ = parts
        model = self._models.get(raw_model)
        if model is None:
            model = self._intern_model(raw_model)
            if model is None:
                self.bad_keys += 1
                return None
        instance = self._names.get(raw_instance)
        if instance is None:
            try:
                instance = validate_instance_id(raw_instance.decode())
            except ValueError:  # UnicodeDecodeError included
                self.bad_keys += 1
                return None
            self._names[raw_instance] = instance
        return model, instance, h

    def _intern_model(self, raw: bytes) -> str | None:
        try:
            model = validate_model(unquote(raw.decode(), errors="strict"))
        except ValueError:  # UnicodeDecodeError included
            return None
        if quote(model, safe="").encode() != raw:
            return None  # not how KeyLayout writes it: "%41" and "A" must not both be model "A"
        self._models[raw] = model
        return model

    def _medium(self, value: bytes) -> str:
        # The writer formats values itself, so the medium sits at a known place; anything else
        # (a value written by another tool) falls back to JSON.
        if value.startswith(b'{"m":"'):
            end = value.find(b'"', 6)
            if end > 0:
                raw = value[6:end]
                medium = self._media.get(raw)
                if medium is None:
                    medium = raw.decode(errors="replace")
                    if len(self._media) < _MAX_MEDIA:
                        self._media[raw] = medium
                return medium
        try:
            doc = json.loads(value)
            medium = doc.get("m", GPU) if isinstance(doc, dict) else GPU
            return medium if isinstance(medium, str) else GPU
        except ValueError:
            return GPU


_MAX_MEDIA = 256
"""Interned medium names kept; media come from values, which another tool could vary freely."""


def write_time(value: bytes) -> float | None:
    """The writer's ``"t"`` (unix time of the write) in a block value, found without a JSON parse
    because it runs once per watched event."""
    i = value.rfind(b'"t":')
    if i < 0:
        return None
    try:
        return float(value[i + 4:].rstrip(b"} "))
    except ValueError:
        return None
