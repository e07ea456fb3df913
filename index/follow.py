"""The get-then-watch loop, written once: read a prefix at one revision, watch from the next.

A subclass says what a snapshot and a watch batch mean (``load`` and ``apply``); this class keeps
the revision, the liveness (``index.liveness``), the counters and the answers to etcd trouble:

- a stream that breaks with an error is resumed from the last applied revision + 1;
- a compacted start revision, or a response larger than the gRPC limit, is answered with a
  reload (a fresh snapshot), since resuming would ask for the same thing again;
- a stream silent for ``stale_after`` seconds despite progress requests is answered with a
  reload too, not a resume. Silence is either a stream that hangs or etcd still producing a very
  large revision, and the two cannot be told apart from here (a single response's progress is
  not visible through gRPC). Resuming would make etcd start that same response over, forever;
  a snapshot always moves past it.

Responses are never fragmented: etcd 3.5 splits a fragmented response by re-measuring it after
each event (``sendFragments``), which is quadratic, so a 60k-event revision took ~20 s to leave
etcd while a watcher timed out and asked again. Unfragmented it is one message built in linear
time (100k deletes in ~0.2 s), within the client's receive limit (``index.etcd``); past that
limit the RESOURCE_EXHAUSTED answer is a reload.

Keys and values are data, never control flow: the prefix is shared, and anything can be written
under it. A subclass says what a key names (``parse_key``) and what a value holds (``decode``);
each raises its ``index.errors.MalformedValue`` for anything else. This class calls them on every
snapshot key and watch event and hands the hooks ``Entry``s: a bad key is skipped (its put or
delete alike), a put of a bad value arrives with ``data`` None (the key holds nothing usable
now), and either is counted by reason (``skipped``, ``skipped_totals()`` for metrics) and
logged once per key and reason, while every other key of the batch applies, deletions included.
An exception other than ``MalformedValue`` from a decoder is a bug there, but a value still must
not stop the watch: it is skipped the same way, as reason ``undecodable``, with its traceback.

"Heard" (for ``connected``) is a response that shows the stream delivers: events or a progress
notification. etcd's "created" response arrives before any catch-up, so it does not count: a
watch reopened behind a backlog it cannot deliver must not read as connected.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

from index.errors import EtcdCompacted, EtcdError, EtcdRequestError, MalformedValue
from index.etcd import EtcdClient, KeyValue, WatchBatch, WatchEvent
from index.lease import Backoff, cancel_and_wait
from index.liveness import WatchLiveness

logger = logging.getLogger(__name__)

BAD_KEY = "bad_key"
"""The reason a key that ``parse_key`` refuses is counted under (``MalformedKey``'s)."""
UNDECODABLE = "undecodable"
"""The reason of a key or value whose decoder raised something other than MalformedValue."""
LOGGED_KEYS = 1024
"""Keys whose refusal is remembered as logged: past that, further ones are counted only (a
flood of bad keys must not grow this set without bound)."""

_TOTALS: Counter[tuple[str, str]] = Counter()
"""Every follower's skips in this process, by (prefix kind, reason): ``skipped_totals()``."""


def skipped_totals() -> dict[tuple[str, str], int]:
    """Keys and values skipped by every follower of this process so far, by (prefix kind,
    reason): monotonic, for a Prometheus counter (the router's and engine's metrics)."""
    return dict(_TOTALS)


@dataclass(frozen=True, slots=True)
class Entry:
    """One snapshot key or watch event, read: what the hooks get."""

    key: bytes
    value: bytes
    """The raw value (b"" for a delete)."""
    put: bool
    """False: the key was deleted (``data`` is None)."""
    mod_revision: int
    name: Any
    """What the key names (``parse_key``)."""
    data: Any
    """The decoded value (``decode``); None for a delete and for a value that does not decode
    (skipped and counted): the key then holds nothing usable."""


class PrefixFollower:
    """Follows every key under ``prefix``; override ``load`` and ``apply`` (and ``parse_key``
    and ``decode`` for keys and values that may be malformed), then ``start()``."""

    kind = "other"
    """Which prefix this follows, for the skip metric's ``prefix_kind`` label."""

    def __init__(self, client: EtcdClient, prefix: bytes, name: str, stale_after: float = 3.0,
                 progress_every: float = 1.0) -> None:
        if not 0 < progress_every < stale_after:
            raise ValueError(f"need 0 < progress_every < stale_after, got {progress_every} and "
                             f"{stale_after}")
        self.client = client
        self.prefix = prefix
        self.name = name
        self.stale_after = stale_after
        self.progress_every = progress_every
        self.revision = 0
        """Every event up to this etcd revision is applied."""
        self.store_revision = 0
        """The newest etcd revision this follower has heard of."""
        self.ready = False
        self._ready = asyncio.Event()
        self._advanced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.liveness = WatchLiveness(client, prefix, stale_after, progress_every)
        self.last_error: str | None = None
        self.batches = 0
        self.reloads = 0
        self.compactions = 0
        self.resumes = 0
        self.disconnects = 0
        self.errors = 0
        """Batches or reloads that failed unexpectedly (each answered with a reload)."""
        self.skipped: Counter[str] = Counter()
        """Keys and values skipped as malformed, by reason (``bad_key``, the decoders')."""
        self._logged: dict[bytes, set[str]] = {}
        """Per refused key, the reasons already logged."""

    # --- what a subclass says ---------------------------------------------------------------

    def load(self, revision: int, entries: list[Entry]) -> Awaitable[None] | None:
        """Replace the whole state with this snapshot of the prefix at ``revision``: every key
        whose key and value read (``data`` is never None here)."""
        raise NotImplementedError

    def apply(self, entries: list[Entry]) -> Awaitable[None] | None:
        """Apply the events of one watch response, in order (those of keys that read; never
        empty)."""
        raise NotImplementedError

    def parse_key(self, key: bytes) -> Any:
        """What ``key`` names (``Entry.name``); raise MalformedValue for a key not to read."""
        return key

    def decode(self, name: Any, value: bytes) -> Any:
        """What ``value`` holds (``Entry.data``); raise MalformedValue for one not to use."""
        return value

    # --- reading keys and values ------------------------------------------------------------

    def _read(self, key: bytes, value: bytes | None, put: bool, mod_revision: int) -> Entry | None:
        """The entry of one key; None (counted, logged once) when the key is refused."""
        try:
            name = self.parse_key(key)
        except Exception as exc:  # noqa: BLE001 - MalformedValue or a decoder's bug: see _refuse
            self._refuse(key, exc)
            return None
        data = None
        if put:
            try:
                data = self.decode(name, value if value is not None else b"")
            except Exception as exc:  # noqa: BLE001
                self._refuse(key, exc)
        if self._logged and (data is not None or not put):
            # The key reads again or is gone: a later refusal of it is logged again.
            self._logged.pop(key, None)
        return Entry(key, value if put and value is not None else b"", put, mod_revision,
                     name, data)

    def _refuse(self, key: bytes, exc: Exception) -> None:
        # A MalformedValue names its reason (bad_key for a key); anything else is a bug in a
        # hook, whichever it was.
        malformed = isinstance(exc, MalformedValue)
        reason = exc.reason if malformed else UNDECODABLE
        self.skipped[reason] += 1
        _TOTALS[(self.kind, reason)] += 1
        seen = self._logged.get(key)
        if seen is None:
            if len(self._logged) >= LOGGED_KEYS:
                return
            seen = self._logged[key] = set()
        if reason in seen:
            return
        seen.add(reason)
        what = "key" if reason == BAD_KEY else "value of"
        if malformed:
            logger.warning("%s: skipped the %s %r (%s): %s; counted in "
                           "skipped[%r], logged once per key", self.name, what, key[:200],
                           reason, exc.detail, reason)
        else:
            logger.error("%s: skipped the %s %r: its decoder failed (a bug there); counted in "
                         "skipped[%r]", self.name, what, key[:200], reason,
                         exc_info=(type(exc), exc, exc.__traceback__))

    def _entries(self, items: Iterable[KeyValue | WatchEvent], snapshot: bool) -> list[Entry]:
        out = []
        for it in items:
            # A snapshot holds only puts (a KeyValue has no ``put``).
            put = True if snapshot else it.put  # type: ignore[union-attr]
            e = self._read(it.key, it.value, put, it.mod_revision)
            # A snapshot holds usable keys only: a bad value there is as good as absent.
            if e is not None and (not snapshot or e.data is not None):
                out.append(e)
        return out

    # --- state ------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """True while the watch delivers and a quorum read succeeds; False before the first
        load, after an etcd error or a silence until the stream delivers again, and while etcd
        has no quorum (the state is then the last one known)."""
        return self.ready and self.liveness.connected

    @property
    def revision_lag(self) -> int:
        """Revisions between etcd's newest known revision and the last applied one."""
        return max(0, self.store_revision - self.revision)

    def follow_stats(self) -> dict[str, object]:
        """The loop's own figures, for a subclass's ``stats()`` to extend."""
        return {"ready": self.ready, "connected": self.connected, "revision": self.revision,
                "store_revision": self.store_revision, "revision_lag": self.revision_lag,
                "batches": self.batches, "reloads": self.reloads,
                "compactions": self.compactions, "resumes": self.resumes,
                "disconnects": self.disconnects, "errors": self.errors,
                "skipped": dict(self.skipped), "last_error": self.last_error}

    async def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the first full load; False on timeout."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def wait_revision(self, revision: int, timeout: float | None = None) -> bool:
        """Wait until every event up to ``revision`` is applied; False on timeout.

        ``revision`` should be one that changed a followed key (a writer's transaction revision):
        only events and reloads move the applied revision forward.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.revision < revision:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._advanced.clear()
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except TimeoutError:
                return self.revision >= revision
        return True

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"follow-{self.name}")
        return self._task

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def run(self) -> None:
        """Follow etcd until cancelled. Never raises on etcd trouble: resumes or reloads."""
        probe = asyncio.create_task(self.liveness.probe(), name=f"follow-probe-{self.name}")
        try:
            await self._follow()
        finally:
            # Not cancel()+gather(): on 3.11 the probe's wait_for can swallow a cancellation that
            # lands as its read completes, and gather would then wait forever.
            await cancel_and_wait(probe)

    async def reload(self) -> None:
        """Replace the whole state with a fresh snapshot (start-up, compaction, silence)."""
        revision, kvs = await self.client.get_prefix(self.prefix)
        await _maybe(self.load(revision, self._entries(kvs, snapshot=True)))
        self.revision = revision
        self.store_revision = max(self.store_revision, revision)
        self.reloads += 1
        self.ready = True
        self.liveness.heard()  # a snapshot read is itself a linearizable read
        self._ready.set()
        self._advanced.set()
        logger.info("%s: loaded %d keys at revision %d", self.name, len(kvs), revision)

    def _watch(self) -> AsyncIterator[WatchBatch]:
        return self.client.watch_prefix(self.prefix, self.revision + 1, self.progress_every)

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
                            # Progress requests keep a healthy watch talking. (asyncio.timeout,
                            # not wait_for: the generator must be cancelled in this task.)
                            async with asyncio.timeout(self.stale_after):
                                batch = await anext(it)
                        except StopAsyncIteration:
                            break
                        await self._on_batch(batch)
                        if not batch.created:  # a stream that only opens is no success yet
                            backoff.reset()
            except asyncio.CancelledError:
                raise
            except TimeoutError:
                self._broke(f"watch silent for {self.stale_after:g} s")
                logger.warning("%s: watch silent for %.1f s at revision %d; reloading",
                               self.name, self.stale_after, self.revision)
                reload = True
                # Backoff: a watch that keeps going silent must not turn into back-to-back
                # snapshots of a large prefix.
                await asyncio.sleep(backoff.next())
            except EtcdCompacted as exc:
                self.compactions += 1
                logger.warning("%s: revision %d compacted (up to %d); reloading",
                               self.name, self.revision + 1, exc.compact_revision)
                reload = True
            except EtcdRequestError as exc:
                # RESOURCE_EXHAUSTED: a response larger than the receive limit. Resuming would
                # hit the same response again.
                self._broke(str(exc))
                reload = reload or "RESOURCE_EXHAUSTED" in str(exc)
                logger.warning("%s: etcd refused the watch at revision %d (%s): %s", self.name,
                               self.revision, "reloading" if reload else "resuming", exc)
                await asyncio.sleep(backoff.next())
            except EtcdError as exc:
                self._broke(str(exc))
                logger.warning("%s: watch broke at revision %d, resuming: %s",
                               self.name, self.revision, exc)
                await asyncio.sleep(backoff.next())
                if not reload:
                    self.resumes += 1
            except Exception as exc:
                # A bug or an input nobody foresaw: the state may be half-applied, so start over
                # from a snapshot rather than die while ``ready`` still says True.
                self.errors += 1
                self.liveness.broke()
                self.last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("%s: failed at revision %d; reloading", self.name, self.revision)
                reload = True
                await asyncio.sleep(backoff.next())

    def _broke(self, why: str) -> None:
        self.disconnects += 1
        self.liveness.broke()
        self.last_error = why

    async def _on_batch(self, batch: WatchBatch) -> None:
        # Only events move ``revision`` (the resume point). Progress notifications and the
        # "created" response only tell etcd's head: before etcd 3.5.8 a progress notification can
        # overtake events of lower revisions still on their way (etcd issue 15220), so trusting
        # it could make a resume skip them.
        self.store_revision = max(self.store_revision, batch.revision)
        if not batch.created:
            self.liveness.heard()
        if not batch.events:
            return
        self.batches += 1
        entries = self._entries(batch.events, snapshot=False)
        if entries:
            await _maybe(self.apply(entries))
        revs = [ev.mod_revision for ev in batch.events]
        # Without per-event revisions the header revision is the best available; it is exact
        # except for catch-up responses spanning more than 1,000 revisions.
        rev = max(revs) if all(revs) else batch.revision
        self.revision = max(self.revision, rev)
        self._advanced.set()


async def _maybe(result: Awaitable[Any] | None) -> None:
    """Await what a hook returned when it is awaitable (hooks may be plain or async)."""
    if result is not None and inspect.isawaitable(result):
        await result
