"""The read side of the etcd block index: an in-memory mirror kept by get-then-watch.

A ``BlockMirror`` reads every block key of one model (or of all models) at one revision, then
watches from that revision + 1 and applies each put/delete to a ``BlockTable`` (the same structure
the memory backend uses, so lookups cost the same). After a disconnect it resumes from the last
applied revision + 1; when etcd has compacted that revision away it reloads everything. Instance
death needs nothing special: etcd deletes the keys with the lease and the deletes arrive here as
ordinary watch events.

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

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from urllib.parse import quote, unquote

from index.errors import EtcdCompacted, EtcdError, EtcdRequestError
from index.etcd import EtcdClient, WatchBatch
from index.keys import KeyLayout, validate_instance_id, validate_model
from index.lease import Backoff, cancel_and_wait
from index.liveness import WatchLiveness
from index.table import GPU, BlockTable
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
    turns False (and a silent watch is reopened). Must exceed ``progress_every``."""

    def __post_init__(self) -> None:
        if not 0.01 <= self.progress_every <= 60:
            raise ValueError(f"progress_every must be within [0.01, 60] s, got {self.progress_every}")
        if self.lag_samples < 1:
            raise ValueError(f"lag_samples must be >= 1, got {self.lag_samples}")
        if not self.progress_every < self.stale_after <= 600:
            raise ValueError(f"stale_after must be within (progress_every, 600] s, "
                             f"got {self.stale_after}")


class BlockMirror:
    """In-memory mirror of ``/blocks/{model}/`` (or of ``/blocks/`` when ``model`` is None)."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, model: str | None = None,
                 config: BlockMirrorConfig | None = None) -> None:
        self.client = client
        self.layout = layout
        self.model = validate_model(model) if model is not None else None
        self.config = config or BlockMirrorConfig()
        self.prefix = layout.blocks_prefix(model)
        self._root_len = len(layout.blocks_prefix())
        self.tables: dict[str, BlockTable] = {}
        self.revision = 0
        """Every event up to this etcd revision is applied."""
        self.store_revision = 0
        """The newest etcd revision this mirror has heard of."""
        self.ready = False
        self._ready = asyncio.Event()
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._models: dict[bytes, str] = {}
        self._names: dict[bytes, str] = {}
        self._media: dict[bytes, str] = {}
        self._lags: deque[float] = deque(maxlen=self.config.lag_samples)
        self.last_error: str | None = None
        self.puts = 0
        self.deletes = 0
        self.batches = 0
        self.reloads = 0
        self.compactions = 0
        self.resumes = 0
        self.disconnects = 0
        self.bad_keys = 0
        self.errors = 0
        """Batches or reloads that failed unexpectedly (each answered with a reload)."""
        self._emptied = False
        self.liveness = WatchLiveness(client, self.prefix, self.config.stale_after,
                                      self.config.progress_every)

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

    @property
    def connected(self) -> bool:
        """True while the watch answers and a quorum read succeeds; False after an etcd error,
        while reconnecting, or when etcd lost quorum (the mirror then serves its last state)."""
        return self.ready and self.liveness.connected

    @property
    def revision_lag(self) -> int:
        """Revisions between etcd's newest known revision and the last applied one."""
        return max(0, self.store_revision - self.revision)

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
            "model": self.model, "ready": self.ready, "connected": self.connected,
            "revision": self.revision,
            "store_revision": self.store_revision, "revision_lag": self.revision_lag,
            "blocks": {m: len(t) for m, t in self.tables.items()},
            "puts": self.puts, "deletes": self.deletes, "batches": self.batches,
            "reloads": self.reloads, "compactions": self.compactions, "resumes": self.resumes,
            "disconnects": self.disconnects, "bad_keys": self.bad_keys, "errors": self.errors,
            "cached_names": len(self._names) + len(self._models),
            "lag_s": self.lag_stats(), "last_error": self.last_error,
        }

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the first full load; False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def wait_revision(self, revision: int, timeout: float | None = None) -> bool:
        """Wait until every event up to ``revision`` is applied; False on timeout.

        ``revision`` should be one that changed a watched key (a writer's transaction revision):
        only events move the applied revision forward.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.revision < revision:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._advanced.clear()
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except asyncio.TimeoutError:
                return self.revision >= revision
        return True

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"block-mirror-{self.model}")
        return self._task

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def run(self) -> None:
        """Follow etcd until cancelled. Never raises on etcd trouble: resumes or reloads."""
        probe = asyncio.create_task(self.liveness.probe(), name=f"block-mirror-probe-{self.model}")
        try:
            await self._follow()
        finally:
            # Not cancel()+gather(): on 3.11 the probe's wait_for can swallow a cancellation that
            # lands as its read completes, and gather would then wait forever.
            await cancel_and_wait(probe)

    async def _follow(self) -> None:
        backoff = Backoff()
        reload = True
        while True:
            try:
                if reload:
                    await self.reload()
                    reload = False
                # aclosing: a batch that fails to apply must close the stream now, not at GC.
                async with contextlib.aclosing(self._watch()) as watch:
                    it = aiter(watch)
                    while True:
                        try:
                            # Progress requests keep a healthy watch talking: silence means the
                            # stream hangs without an error, so reopen it. (asyncio.timeout, not
                            # wait_for: the generator must be cancelled in this task.)
                            async with asyncio.timeout(self.config.stale_after):
                                batch = await anext(it)
                        except StopAsyncIteration:
                            break
                        self._on_batch(batch)
                        backoff.reset()
            except asyncio.CancelledError:
                raise
            except asyncio.TimeoutError:
                self.disconnects += 1
                self.liveness.broke()
                self.last_error = f"watch silent for {self.config.stale_after:g} s"
                logger.warning("block mirror %s: watch silent for %.1f s at revision %d; reopening",
                               self.model, self.config.stale_after, self.revision)
                self.resumes += 1
            except EtcdCompacted as exc:
                self.compactions += 1
                logger.warning("block mirror %s: revision %d compacted (up to %d); reloading",
                               self.model, self.revision + 1, exc.compact_revision)
                reload = True
            except EtcdRequestError as exc:
                # RESOURCE_EXHAUSTED: a watch response larger than the gRPC message limit (a huge
                # lease expiry without fragmenting). Resuming would hit the same response again.
                self.disconnects += 1
                self.liveness.broke()
                self.last_error = str(exc)
                reload = reload or "RESOURCE_EXHAUSTED" in str(exc)
                logger.warning("block mirror %s: etcd refused the watch at revision %d (%s): %s",
                               self.model, self.revision,
                               "reloading" if reload else "resuming", exc)
                await asyncio.sleep(backoff.next())
            except EtcdError as exc:
                self.disconnects += 1
                self.liveness.broke()
                self.last_error = str(exc)
                logger.warning("block mirror %s: watch broke at revision %d, resuming: %s",
                               self.model, self.revision, exc)
                await asyncio.sleep(backoff.next())
                if not reload:
                    self.resumes += 1
            except Exception as exc:
                # A bug or an input nobody foresaw: the mirror may be half-applied, so start over
                # from a snapshot rather than die while ``ready`` still says True.
                self.errors += 1
                self.liveness.broke()
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("block mirror %s: failed at revision %d; reloading",
                                 self.model, self.revision)
                reload = True
                await asyncio.sleep(backoff.next())

    def _watch(self) -> AsyncIterator[WatchBatch]:
        return self.client.watch_prefix(self.prefix, self.revision + 1,
                                        self.config.progress_every, fragment=True)

    async def reload(self) -> None:
        """Replace the whole mirror with a fresh snapshot (start-up and after compaction)."""
        revision, kvs = await self.client.get_prefix(self.prefix)
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
        # Swap at once: lookups see either the old or the new state, never a half-built one.
        self.tables = tables
        self.revision = revision
        self.store_revision = max(self.store_revision, revision)
        self.reloads += 1
        self.ready = True
        self.liveness.heard()
        self._ready.set()
        self._advanced.set()
        logger.info("block mirror %s loaded %d keys at revision %d", self.model, len(kvs), revision)

    # --- applying watch events --------------------------------------------------------------

    def _on_batch(self, batch: WatchBatch) -> None:
        # Only events move ``revision`` (the resume point). Progress notifications and the
        # "created" response only tell etcd's head: before etcd 3.5.8 a progress notification can
        # overtake events of lower revisions still on their way (etcd issue 15220), so trusting
        # it could make a resume skip them.
        self.store_revision = max(self.store_revision, batch.revision)
        self.liveness.heard()
        if batch.events:
            self.batches += 1
            self._apply(batch)
            revs = [getattr(ev, "mod_revision", 0) for ev in batch.events]
            # Without per-event revisions the header revision is the best available; it is exact
            # except for catch-up responses spanning more than 1,000 revisions.
            rev = max(revs) if all(revs) else batch.revision
            self.revision = max(self.revision, rev)
            self._advanced.set()
            if self._emptied:
                self._prune()

    def _prune(self) -> None:
        """Forget caches of instances and models that hold no blocks any more."""
        self._emptied = False
        for name in [m for m, t in self.tables.items() if not len(t) and m != self.model]:
            del self.tables[name]
        live: set[str] = set()
        for t in self.tables.values():
            live |= t.instances()
        self._names = {raw: n for raw, n in self._names.items() if n in live}
        self._models = {raw: m for raw, m in self._models.items() if m in self.tables}

    def _apply(self, batch: WatchBatch) -> None:
        # Consecutive events of one kind for one instance are applied as one table call.
        run_key: tuple[bool, str, str, str] | None = None
        run: list[int] = []
        stamps: list[float] = []
        for ev in batch.events:
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
                self._flush_run(run_key, run)
                run_key, run = key, []
            run.append(h)
        self._flush_run(run_key, run)
        if stamps:
            now = time.time()
            self._lags.extend(now - t for t in stamps)

    def _flush_run(self, key: tuple[bool, str, str, str] | None, hashes: list[int]) -> None:
        if key is None or not hashes:
            return
        put, model, instance, medium = key
        table = self._writable(model)
        if put:
            self.puts += len(hashes)
            table.apply_add(instance, hashes, medium)
        else:
            self.deletes += len(hashes)
            table.apply_remove(instance, hashes)
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
