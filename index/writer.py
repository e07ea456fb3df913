"""The etcd block writer: one per instance, mirroring the instance's block set into etcd.

The in-memory block set (hash -> medium, parent) is the authority; etcd holds a copy of it under
``/{prefix}/v1/blocks/{model}/{instance_id}/{hash:016x}``, written under the instance lease so that
the keys vanish when the instance dies. etcd's write rate is the price of a shared index, so:

- Changes are coalesced per hash in a flush window (``flush_interval`` or ``flush_ops``). Each
  pending entry remembers what etcd holds for that hash; a change that brings a hash back to that
  state (a block added and removed in one window) drops the entry and writes nothing.
- Pending changes go out as transactions of at most ``txn_ops`` ops (etcd's ``--max-txn-ops``),
  ``max_inflight`` of them at once. A hash that is in an in-flight transaction is never put in a
  second one until the first lands, so two transactions can never reorder writes to one key.
- ``clear()`` is one range delete of the instance's prefix, not one delete per block.
- Memory is bounded: pending is keyed by hash, so it cannot outgrow the set plus the removals of
  one window; past ``max_pending`` the writer drops it and switches to "resync needed".
- After any etcd failure, a new lease, or an overflow it does a full resync: it reads its own
  prefix, deletes keys that are not in the set and puts the blocks that are missing, stale or under
  another lease. A resync after a short outage therefore writes only the difference.
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

logger = logging.getLogger(__name__)

_MAX_HASH = 2**64 - 1

Entry = tuple[str, "int | None"]  # (medium, parent hash or None)


@dataclass
class BlockWriterConfig:
    """How a ``BlockWriter`` batches block changes into etcd."""

    flush_interval: float = 0.010
    """Seconds a first pending change waits for more before a flush (the coalescing window)."""
    flush_ops: int = 1000
    """A flush starts at once when this many hashes are pending, whatever the window."""
    txn_ops: int = 128
    """Ops per etcd transaction; must not exceed etcd's ``--max-txn-ops`` (default 128)."""
    max_inflight: int = 6
    """Transactions in flight at once; more hides latency, too many only queues inside etcd."""
    max_pending: int = 250_000
    """Pending hashes past which the writer stops tracking changes and resyncs the whole set."""

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
    """Keeps ``/blocks/{model}/{instance_id}/`` in etcd equal to this instance's block set.

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
        self.prefix = layout.blocks_prefix(model, instance_id)
        self._blocks: dict[int, Entry] = {}
        # hash -> what etcd holds for it once in-flight transactions land (None: absent).
        self._pending: dict[int, Entry | None] = {}
        self._pending_since: float | None = None
        self._inflight_keys: set[int] = set()
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
        self.coalesced = 0
        self.blocks_written = 0
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
        blocks, pending, track = self._blocks, self._pending, not self._resync_needed
        prev = parent
        changed = 0
        for h in hashes:
            new = (medium, prev)
            old = blocks.get(h)
            prev = h
            if old == new:
                continue
            blocks[h] = new
            changed += 1
            if track:
                if h in pending:
                    self.coalesced += 1
                    if pending[h] == new:
                        del pending[h]
                else:
                    pending[h] = old
        self._changed(changed)

    def remove(self, hashes: Sequence[int]) -> None:
        """``hashes`` are no longer held; unknown hashes are ignored."""
        blocks, pending, track = self._blocks, self._pending, not self._resync_needed
        changed = 0
        for h in hashes:
            old = blocks.pop(h, None)
            if old is None:
                continue
            changed += 1
            if track:
                if h in pending:
                    self.coalesced += 1
                    if pending[h] is None:
                        del pending[h]
                else:
                    pending[h] = old
        self._changed(changed)

    def clear(self) -> None:
        """Forget every block: one range delete of this instance's prefix."""
        n = len(self._blocks)
        if n == 0 and not self._pending:
            return
        self._blocks.clear()
        # After the range delete etcd holds nothing, so nothing that was pending still matters.
        self.coalesced += len(self._pending)
        self._pending.clear()
        if not self._resync_needed:
            self._clear_pending = True
        self._changed(max(n, 1))

    def _changed(self, n: int) -> None:
        if n == 0:
            return
        self.changes += n
        self._idle.clear()
        if self._pending and self._pending_since is None:
            self._pending_since = time.monotonic()
        if len(self._pending) > self.config.max_pending:
            self.overflows += 1
            self._need_resync(f"{len(self._pending)} pending changes exceed max_pending "
                              f"{self.config.max_pending}")
        if len(self._pending) >= self.config.flush_ops:
            self._full.set()
        self._wake.set()

    def blocks(self) -> dict[int, Entry]:
        """A copy of the set: hash -> (medium, parent). O(set size): use ``entry`` for one."""
        return dict(self._blocks)

    def entry(self, h: int) -> Entry | None:
        """(medium, parent) of block ``h``, or None when it is not held. O(1)."""
        return self._blocks.get(h)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._blocks

    # --- status -----------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Changes not yet acknowledged by etcd (the whole set while a resync is needed)."""
        if self._resync_needed:
            return len(self._blocks)
        return len(self._pending) + len(self._inflight_keys) + int(self._clear_pending)

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
            "blocks": len(self._blocks), "pending": self.pending, "lag_s": round(self.lag, 6),
            "changes": self.changes, "coalesced": self.coalesced,
            "blocks_written": self.blocks_written, "deletes_written": self.deletes_written,
            "txns": self.txns, "resyncs": self.resyncs, "failures": self.failures,
            "overflows": self.overflows, "last_revision": self.last_revision,
            "last_error": self.last_error,
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
        self._pending.clear()
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
                elif self._pending:
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
        while len(self._pending) < self.config.flush_ops and not self._resync_needed:
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
        budget = len(self._pending)
        while budget > 0 and self._pending and not self._resync_needed and not self._clear_pending:
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
            ops = self._ops(keys, lease)
            task = asyncio.create_task(self._send(ops, keys, lease))
            self._inflight[task] = self._pending_since or time.monotonic()
            if not self._pending:
                self._pending_since = None

    def _take(self, n: int) -> list[int]:
        busy = self._inflight_keys
        keys: list[int] = []
        for h in self._pending:
            if h not in busy:
                keys.append(h)
                if len(keys) >= n:
                    break
        pending = self._pending
        for h in keys:
            del pending[h]
        busy.update(keys)
        return keys

    def _ops(self, keys: list[int], lease: int) -> list[Put | Delete]:
        t = b"%.4f}" % time.time()
        prefix, blocks = self.prefix, self._blocks
        ops: list[Put | Delete] = []
        for h in keys:
            entry = blocks.get(h)
            key = prefix + b"%016x" % h
            if entry is None:
                ops.append(Delete(key))
            else:
                ops.append(Put(key, _head(entry) + b',"t":' + t, lease))
        return ops

    async def _send(self, ops: list[Put | Delete], keys: list[int], lease: int) -> None:
        try:
            rev = await self.client.txn(ops)
            self._count(ops, rev)
        except asyncio.CancelledError:
            raise
        except LeaseExpired:
            self._fail("lease expired", lease)
        except EtcdError as exc:
            self._fail(str(exc), None)
        finally:
            self._inflight_keys.difference_update(keys)
            self._inflight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._slots.release()
            self._wake.set()

    def _count(self, ops: Sequence[Put | Delete], rev: int) -> None:
        self.txns += 1
        puts = sum(1 for op in ops if isinstance(op, Put))
        self.blocks_written += puts
        self.deletes_written += len(ops) - puts
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
        """Make etcd equal the set: delete keys not in it, put blocks missing or not identical."""
        self.state = "resyncing"
        await self._drain()
        # From here on, changes are tracked again relative to the snapshot that etcd will hold.
        self._resync_needed = False
        self._clear_pending = False
        self._pending.clear()
        self._pending_since = None
        snapshot = dict(self._blocks)
        try:
            _, kvs = await self.client.get_prefix(self.prefix)
            ops: list[Put | Delete] = []
            current: set[int] = set()
            plen = len(self.prefix)
            for kv in kvs:
                h = parse_hash_tail(kv.key[plen:])
                entry = snapshot.get(h) if h is not None else None
                if entry is None:
                    ops.append(Delete(kv.key))
                elif kv.lease == lease and kv.value.startswith(_head(entry) + b',"t":'):
                    current.add(h)  # type: ignore[arg-type]
            stale = len(ops)
            t = b"%.4f}" % time.time()
            for h, entry in snapshot.items():
                if h not in current:
                    ops.append(Put(self.prefix + b"%016x" % h, _head(entry) + b',"t":' + t, lease))
            await self._write(ops, lease)
        except BaseException:
            self._need_resync("resync interrupted")
            raise
        self._lease = lease
        self.resyncs += 1
        self._resync_since = None
        self.last_error = None
        self.state = "streaming"
        logger.info("block writer %s/%s resynced: %d blocks, %d written, %d stale deleted",
                    self.model, self.instance_id, len(snapshot), len(ops) - stale, stale)


def _head(entry: Entry) -> bytes:
    """The JSON value up to the write time: ``{"m":"GPU","p":"<parent hex>"|null``."""
    medium, parent = entry
    p = b"null" if parent is None else b'"%016x"' % parent
    return b'{"m":"' + medium.encode() + b'","p":' + p


def parse_hash_tail(tail: bytes) -> int | None:
    """The hash of a canonical ``{hash:016x}`` key tail (16 lowercase hex digits), else None.

    ``int(tail, 16)`` alone also takes ``-000000000000001``, ``0x``, ``_`` and blanks, so the
    round trip decides (only the exact form this writer produces is a block key), after the sign
    check: ``b"%016x" % -1`` is ``-000000000000001`` again.
    """
    if len(tail) != 16:
        return None
    try:
        h = int(tail, 16)
    except ValueError:
        return None
    return h if h >= 0 and b"%016x" % h == tail else None
