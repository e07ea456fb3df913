"""The etcd block writer: one per instance, mirroring the instance's block set into etcd.

The in-memory block set (hash -> medium, parent) is the authority; etcd holds a copy of it as
chain segments (``index.segments``), one key per segment under
``/{prefix}/v2/blocks/{model}/{instance_id}/``, written under the instance lease so that the keys
vanish when the instance dies. etcd's cost is per key written, so:

- Blocks are grouped: a stored chain goes into one segment (up to ``MAX_SEGMENT_BLOCKS``), and a
  block whose parent ends a segment joins it (a decode's one-block stores included). A change
  marks its segment dirty; a flush window (``flush_interval`` or ``flush_ops`` dirty segments)
  writes each dirty segment once, whatever number of its blocks changed.
- A held block stays in its segment. One removed goes back to the same segment if it returns
  before its removal is in etcd, so that no reader can see a block enter one segment before it
  left another (a reader applies each segment's content in revision order and keeps no
  per-block owner).
- Dirty segments go out as transactions of at most ``txn_ops`` ops (etcd's ``--max-txn-ops``),
  ``max_inflight`` of them at once. A segment in an in-flight transaction is never put in a
  second one until the first lands, so two transactions never reorder writes to one key.
- ``clear()`` is one range delete of the instance's prefix.
- After any etcd failure, a new lease, or more than ``max_pending`` dirty segments it does a
  full resync: it reads its own prefix, deletes keys that are not a segment any more and puts the
  segments that are missing, differ or sit under another lease, so a resync after a short outage
  writes only the difference.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from index.block_index import valid_medium
from index.errors import EtcdError, LeaseExpired
from index.etcd import Delete, EtcdClient, Put
from index.keys import KeyLayout, validate_instance_id, validate_model
from index.lease import Backoff, LeaseSession, cancel_and_wait
from index.segment_set import Entry, SegmentSet
from index.segments import same_content

logger = logging.getLogger(__name__)

_MAX_HASH = 2**64 - 1

__all__ = ["BlockWriter", "BlockWriterConfig", "Entry", "parse_hash_tail"]


@dataclass
class BlockWriterConfig:
    """How a ``BlockWriter`` batches block changes into etcd."""

    flush_interval: float = 0.010
    """Seconds a first pending change waits for more before a flush (the coalescing window)."""
    flush_ops: int = 1000
    """A flush starts at once when this many segments are dirty, whatever the window."""
    txn_ops: int = 128
    """Ops per etcd transaction; must not exceed etcd's ``--max-txn-ops`` (default 128)."""
    max_inflight: int = 6
    """Transactions in flight at once; more hides latency, too many only queues inside etcd."""
    max_pending: int = 250_000
    """Dirty segments past which the writer stops tracking changes and resyncs the whole set."""

    def __post_init__(self) -> None:
        if not 0 <= self.flush_interval <= 10:
            raise ValueError(f"flush_interval must be within [0, 10] s, got {self.flush_interval}")
        if self.flush_ops < 1:
            raise ValueError(f"flush_ops must be >= 1, got {self.flush_ops}")
        if not 1 <= self.txn_ops <= 10_000:
            raise ValueError(f"txn_ops must be within [1, 10000] (etcd's --max-txn-ops), "
                             f"got {self.txn_ops}")
        if not 1 <= self.max_inflight <= 256:
            raise ValueError(f"max_inflight must be within [1, 256], got {self.max_inflight}")
        if self.max_pending < self.flush_ops:
            raise ValueError(f"max_pending ({self.max_pending}) must be >= flush_ops "
                             f"({self.flush_ops})")


class BlockWriter:
    """Keeps ``/v2/blocks/{model}/{instance_id}/`` in etcd equal to this instance's block set.

    ``add``/``remove``/``clear`` change the set at once (they never wait for etcd); ``run()`` is the
    background task that writes. ``session`` may be shared with the instance's other leased keys.
    """

    def __init__(self, session: LeaseSession, layout: KeyLayout, model: str, instance_id: str,
                 config: BlockWriterConfig | None = None) -> None:
        self.session = session
        self.client: EtcdClient = session.client
        self.model = validate_model(model)
        self.instance_id = validate_instance_id(instance_id)
        self.config = config or BlockWriterConfig()
        self.layout = layout
        self.prefix = layout.blocks_prefix(model, instance_id)
        self._set = SegmentSet()
        self._set.track = False  # until the first resync, which writes everything
        # Dirty segments are ``self._set.dirty``; these are in an in-flight transaction.
        self._pending_since: float | None = None
        self._inflight_keys: set[int] = set()
        self._carried: dict[bytes, int] = {}
        """Blocks in each segment value about to be written (for ``blocks_written``)."""
        self._inflight: dict[asyncio.Task[None], float] = {}
        self._slots = asyncio.Semaphore(self.config.max_inflight)
        self._resync_needed = True
        self._resync_since: float | None = time.monotonic()
        self._clear_pending = False
        self._lease: int | None = None
        self._wake = asyncio.Event()
        self._full = asyncio.Event()
        self._idle = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.state = "connecting"
        """connecting -> resyncing -> streaming (changes on their way) <-> synced (etcd holds
        exactly the set); resync_needed after an overflow or a new lease; degraded while etcd
        fails (it retries, then resyncs)."""
        self.last_error: str | None = None
        self.last_revision = 0
        self.changes = 0
        self.blocks_written = 0
        """Blocks carried by the segment values written (a segment rewritten counts all of its
        blocks)."""
        self.segments_written = 0
        self.deletes_written = 0
        self.txns = 0
        self.resyncs = 0
        self.failures = 0
        self.overflows = 0
        session.on_new_lease(self._on_new_lease)

    # --- the block set (synchronous; never waits for etcd) -----------------------------------

    def add(self, parent: int | None, hashes: Sequence[int], medium: str = "GPU") -> None:
        """``hashes`` (consecutive blocks after ``parent``) are now held on ``medium``."""
        if not valid_medium(medium):
            raise ValueError(f"medium {medium!r} is invalid: use 1-32 letters, digits, '_.-'")
        for h in hashes:
            if not 0 <= h <= _MAX_HASH:
                raise ValueError(f"block hash {h!r} is not an unsigned 64-bit integer")
        self._changed(self._set.add(parent, hashes, medium))

    def remove(self, hashes: Sequence[int]) -> None:
        """``hashes`` are no longer held; unknown hashes are ignored."""
        self._changed(self._set.remove(hashes))

    def clear(self) -> None:
        """Forget every block: one range delete of this instance's prefix."""
        if not self._set.blocks and not self._set.dirty:
            return
        n = self._set.clear()
        if not self._resync_needed:
            self._clear_pending = True
        self._changed(max(n, 1))

    def _changed(self, n: int) -> None:
        if n == 0:
            return
        self.changes += n
        self._idle.clear()
        if self._set.dirty and self._pending_since is None:
            self._pending_since = time.monotonic()
        dirty = len(self._set.dirty)
        if dirty > self.config.max_pending:
            self.overflows += 1
            self._need_resync(f"{dirty} dirty segments exceed max_pending "
                              f"{self.config.max_pending}")
        if dirty >= self.config.flush_ops:
            self._full.set()
        self._wake.set()

    def blocks(self) -> dict[int, Entry]:
        """A copy of the set: hash -> (medium, parent). O(set size): use ``entry`` for one."""
        return dict(self._set.blocks)

    def entry(self, h: int) -> Entry | None:
        """(medium, parent) of block ``h``, or None when it is not held. O(1)."""
        return self._set.blocks.get(h)

    def __len__(self) -> int:
        return len(self._set.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._set.blocks

    @property
    def segments(self) -> int:
        """Segments holding at least one block."""
        return self._set.segments

    # --- status -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Segments whose changes etcd has not acknowledged (every segment while a resync is
        needed)."""
        if self._resync_needed:
            return self._set.segments
        changed = sum(1 for seg in self._set.dirty if self._set.changed(seg))
        return changed + len(self._inflight_keys) + int(self._clear_pending)

    @property
    def lag(self) -> float:
        """Seconds the oldest change that etcd has not acknowledged has waited (0 when synced)."""
        now = time.monotonic()
        starts = list(self._inflight.values())
        if self._resync_since is not None:
            starts.append(self._resync_since)
        if self._pending_since is not None:
            starts.append(self._pending_since)
        return max(0.0, now - min(starts)) if starts else 0.0

    def stats(self) -> dict[str, object]:
        return {
            "instance_id": self.instance_id, "model": self.model, "state": self.state,
            "blocks": len(self._set.blocks), "segments": self.segments, "pending": self.pending,
            "lag_s": round(self.lag, 6), "changes": self.changes,
            "blocks_written": self.blocks_written, "segments_written": self.segments_written,
            "deletes_written": self.deletes_written, "txns": self.txns,
            "resyncs": self.resyncs, "failures": self.failures, "overflows": self.overflows,
            "last_revision": self.last_revision, "last_error": self.last_error,
        }

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until etcd holds exactly the current set; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"block-writer-{self.instance_id}")
        return self._task

    async def close(self) -> None:
        """Stop writing (the keys stay in etcd until the lease goes)."""
        await cancel_and_wait(self._task, *self._inflight)
        self._task = None

    def _on_new_lease(self, lease_id: int) -> None:
        if lease_id != self._lease:
            self._need_resync(f"new lease {lease_id:x}")

    def _need_resync(self, why: str) -> None:
        if not self._resync_needed:
            logger.info("block writer %s/%s: resync needed (%s)", self.model, self.instance_id, why)
            self._resync_needed = True
            self._resync_since = time.monotonic()
        if self.state != "degraded":
            self.state = "resync_needed"
        self._set.track = False
        self._set.dirty.clear()
        self._pending_since = None
        self._clear_pending = False
        self._idle.clear()
        self._wake.set()

    # --- the write loop ---------------------------------------------------------------------

    async def run(self) -> None:
        """Write changes until cancelled. Never raises on etcd trouble: it resyncs and retries."""
        backoff = Backoff()
        while True:
            lease: int | None = None
            try:
                lease = await self.session.wait_lease()
                if self._resync_needed or self._lease != lease:
                    await self._full_resync(lease)
                    backoff.reset()
                elif self._clear_pending:
                    await self._drain()
                    self._clear_pending = False
                    await self._write([Delete(self.prefix, prefix=True)], lease)
                elif self._set.dirty:
                    await self._window()
                    await self._flush(lease)
                    backoff.reset()
                else:
                    if not self._inflight:
                        self.state = "synced"
                        self._idle.set()
                    self._wake.clear()
                    await self._wake.wait()
            except LeaseExpired:
                # The lease this attempt used is the one to report: ``self._lease`` is still the
                # previous one while a resync under a new lease fails, and the session ignores
                # reports of a lease it no longer holds (the writer would spin on the dead one).
                self._fail("lease expired", lease)
                await asyncio.sleep(backoff.next())
            except EtcdError as exc:
                self._fail(str(exc), None)
                await asyncio.sleep(backoff.next())

    async def _window(self) -> None:
        """Let changes accumulate until the window closes or enough are pending."""
        if self._pending_since is None:
            self._pending_since = time.monotonic()
        deadline = self._pending_since + self.config.flush_interval
        while len(self._set.dirty) < self.config.flush_ops and not self._resync_needed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._full.clear()
            try:
                await asyncio.wait_for(self._full.wait(), left)
            except TimeoutError:
                return

    async def _flush(self, lease: int) -> None:
        """Send what is pending now as transactions, at most ``max_inflight`` at once."""
        self.state = "streaming"
        budget = len(self._set.dirty)
        while (budget > 0 and self._set.dirty and not self._resync_needed
               and not self._clear_pending):
            # Waiting for a slot is the back-pressure: meanwhile new changes keep coalescing.
            await self._slots.acquire()
            if self._resync_needed or self._clear_pending or self._lease != lease:
                self._slots.release()
                return
            keys = self._take(min(self.config.txn_ops, budget))
            if not keys:
                # Everything pending is in flight already: let one transaction land first.
                self._slots.release()
                if not self._inflight:
                    return
                await asyncio.wait(list(self._inflight), return_when=asyncio.FIRST_COMPLETED)
                continue
            budget -= len(keys)
            ops, settles = self._ops(keys, lease)
            if not ops:
                # Changed and changed back since the last write: nothing to send.
                self._inflight_keys.difference_update(keys)
                self._slots.release()
                continue
            task = asyncio.create_task(self._send(ops, keys, settles, lease))
            self._inflight[task] = self._pending_since or time.monotonic()
            if not self._set.dirty:
                self._pending_since = None

    def _take(self, n: int) -> list[int]:
        busy = self._inflight_keys
        keys: list[int] = []
        pending = self._set.dirty
        for s in pending:
            if s not in busy:
                keys.append(s)
                if len(keys) >= n:
                    break
        for s in keys:
            del pending[s]
        busy.update(keys)
        return keys

    def _ops(self, keys: list[int], lease: int) -> tuple[list[Put | Delete], dict[int, set[int]]]:
        """The writes of segments ``keys`` as they are now, and per segment the removals they
        carry (settled once they land)."""
        t = time.time()
        changed = [s for s in keys if self._set.changed(s)]
        settles = {s: gone for s in changed if (gone := self._set.take_removals(s))}
        return [self._segment_op(s, t, lease) for s in changed], settles

    def _segment_op(self, s: int, t: float, lease: int) -> Put | Delete:
        key = self.layout.segment(self.model, self.instance_id, s)
        n = self._set.size(s)
        value = self._set.value(s, t)
        if value is None:
            return Delete(key)
        self._carried[key] = n
        return Put(key, value, lease)

    async def _send(self, ops: list[Put | Delete], keys: list[int],
                    settles: dict[int, set[int]], lease: int) -> None:
        try:
            rev = await self.client.txn(ops)
            self._count(ops, rev)
            self._set.settle(settles)
        except asyncio.CancelledError:
            raise
        except LeaseExpired:
            self._set.unsettle(settles)
            self._fail("lease expired", lease)
        except EtcdError as exc:
            self._set.unsettle(settles)
            self._fail(str(exc), None)
        finally:
            self._inflight_keys.difference_update(keys)
            self._inflight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._slots.release()
            self._wake.set()

    def _count(self, ops: Sequence[Put | Delete], rev: int) -> None:
        self.txns += 1
        for op in ops:
            if isinstance(op, Put):
                self.segments_written += 1
                self.blocks_written += self._carried.pop(op.key, 0)
            else:
                self.deletes_written += 1
        self.last_revision = max(self.last_revision, rev)

    def _fail(self, why: str, lease: int | None) -> None:
        self.failures += 1
        if self.state != "degraded":
            logger.warning("block writer %s/%s degraded, will resync: %s", self.model,
                           self.instance_id, why)
        self.state, self.last_error = "degraded", why
        self._need_resync(why)
        if lease is not None:
            self.session.lost(lease)

    async def _drain(self) -> None:
        """Wait until no transaction is in flight."""
        while self._inflight:
            await asyncio.wait(list(self._inflight))

    async def _write(self, ops: list[Put | Delete], lease: int) -> None:
        """Write ``ops`` in transactions of ``txn_ops``, ``max_inflight`` at once; raise on failure."""
        size = self.config.txn_ops
        chunks = iter([ops[i:i + size] for i in range(0, len(ops), size)])

        async def worker() -> None:
            for chunk in chunks:
                self._count(chunk, await self.client.txn(chunk))

        workers = [asyncio.create_task(worker()) for _ in range(self.config.max_inflight)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _full_resync(self, lease: int) -> None:
        """Make etcd equal the segments: delete keys that are no segment, put segments missing,
        different or under another lease."""
        self.state = "resyncing"
        await self._drain()
        # From here on, changes are tracked again relative to the state etcd will hold.
        self._resync_needed = False
        self._clear_pending = False
        segs = self._set
        segs.track = True
        segs.dirty.clear()
        self._pending_since = None
        # This resync writes every segment etcd does not hold as it is now: once it lands,
        # every removal so far is settled.
        removals = segs.take_all_removals()
        # The segments as they are now, before any await: what changes meanwhile is dirty and
        # written after (a clear() meanwhile range-deletes after this resync).
        t = time.time()
        snapshot = {s: (segs.value(s, t), segs.size(s)) for s in list(segs.live())}
        try:
            _, kvs = await self.client.get_prefix(self.prefix)
            ops: list[Put | Delete] = []
            same: set[int] = set()
            plen = len(self.prefix)
            for kv in kvs:
                s = parse_hash_tail(kv.key[plen:])
                if s is None or s not in snapshot:
                    ops.append(Delete(kv.key))
                elif kv.lease == lease and same_content(kv.value, snapshot[s][0]):
                    same.add(s)
            stale = len(ops)
            for s, (value, n) in snapshot.items():
                if s not in same and value is not None:
                    key = self.layout.segment(self.model, self.instance_id, s)
                    self._carried[key] = n
                    ops.append(Put(key, value, lease))
            await self._write(ops, lease)
        except BaseException:
            segs.unsettle(removals)
            self._need_resync("resync interrupted")
            raise
        segs.settle(removals)
        self._lease = lease
        self.resyncs += 1
        self._resync_since = None
        self.last_error = None
        self.state = "streaming"
        logger.info("block writer %s/%s resynced: %d blocks in %d segments, %d written, %d "
                    "stale deleted", self.model, self.instance_id, len(segs), len(snapshot),
                    len(ops) - stale, stale)

def parse_hash_tail(tail: bytes) -> int | None:
    """The value of a canonical ``{id:016x}`` key tail (16 lowercase hex digits), else None.

    ``int(tail, 16)`` alone also takes ``-000000000000001``, ``0x``, ``_`` and blanks, so the
    round trip decides (only the exact form this writer produces is a segment key), after the
    sign check: ``b"%016x" % -1`` is ``-000000000000001`` again.
    """
    if len(tail) != 16:
        return None
    try:
        h = int(tail, 16)
    except ValueError:
        return None
    return h if h >= 0 and b"%016x" % h == tail else None
