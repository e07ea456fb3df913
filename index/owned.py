"""A small set of keys that one instance owns in etcd, kept equal to an in-memory desired state.

The in-memory state is the authority; etcd is a mirror of it. Changes are written in the
background under the instance lease. After any failure, and after every new lease, the whole set
is rewritten and this owner's keys that are no longer desired are deleted, so etcd converges to
the desired state whatever happened while it was away. Meant for tens to thousands of keys
(an instance record, a rank table); the block index has its own batching writer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from index.errors import EtcdError, LeaseExpired
from index.etcd import Delete, EtcdClient, Put
from index.lease import Backoff, LeaseSession

logger = logging.getLogger(__name__)

TXN_MAX_OPS = 128  # etcd's default --max-txn-ops


class LeasedKeys:
    """Mirror ``desired`` (key -> value) into etcd under ``session``'s lease.

    ``owned_prefixes`` are the ranges this owner is authoritative for: on a full resync, keys
    under them that are not desired are deleted (left over from a previous run with the same id).
    """

    def __init__(self, session: LeaseSession, owned_prefixes: Iterable[bytes]) -> None:
        self.session = session
        self.client: EtcdClient = session.client
        self.owned_prefixes = tuple(owned_prefixes)
        self._desired: dict[bytes, bytes] = {}
        self._dirty: set[bytes] = set()
        self._needs_full = True
        self._wake = asyncio.Event()
        self._synced = asyncio.Event()
        self._dirty_since: float | None = None
        self.synced_lease: int | None = None
        self.state = "connecting"
        self.last_error: str | None = None
        self.full_resyncs = 0
        self.writes = 0
        session.on_new_lease(self._on_new_lease)

    # --- the desired state ------------------------------------------------------------------

    def set(self, key: bytes, value: bytes) -> None:
        if self._desired.get(key) == value:
            return
        self._desired[key] = value
        self._touch(key)

    def delete(self, key: bytes) -> None:
        if self._desired.pop(key, None) is not None:
            self._touch(key)

    def desired(self) -> dict[bytes, bytes]:
        return dict(self._desired)

    def _touch(self, key: bytes) -> None:
        self._dirty.add(key)
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        self._synced.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._dirty) + (len(self._desired) if self._needs_full else 0)

    @property
    def lag(self) -> float:
        """Seconds the oldest change not yet in etcd has waited (0 when synced)."""
        return 0.0 if self._dirty_since is None else time.monotonic() - self._dirty_since

    async def wait_synced(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # --- the sync loop ----------------------------------------------------------------------

    def _on_new_lease(self, lease_id: int) -> None:
        self._needs_full = True
        self._synced.clear()
        self._wake.set()

    async def run(self) -> None:
        """Keep etcd equal to the desired state until cancelled; retries every etcd failure."""
        backoff = Backoff()
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            lease = await self.session.wait_lease()
            try:
                if self._needs_full or self.synced_lease != lease:
                    await self._full_resync(lease)
                else:
                    await self._flush(lease)
                backoff.reset()
                if self.state != "synced":
                    logger.info("etcd mirror synced (%d keys)", len(self._desired))
                self.state, self.last_error = "synced", None
                if not self._dirty and not self._needs_full:
                    self._dirty_since = None
                    self._synced.set()
                else:
                    # Changes (or a new lease) arrived while writing: they are the lag now.
                    self._dirty_since = time.monotonic()
                    self._wake.set()
            except LeaseExpired:
                self._needs_full = True
                self.session.lost(lease)
                self._wake.set()
            except EtcdError as exc:
                self._needs_full = True
                if self.state != "degraded":
                    logger.warning("etcd mirror degraded, serving from memory and retrying: %s", exc)
                self.state, self.last_error = "degraded", str(exc)
                await asyncio.sleep(backoff.next())
                self._wake.set()

    async def _flush(self, lease: int) -> None:
        keys, self._dirty = self._dirty, set()
        try:
            ops: list[Put | Delete] = []
            for key in sorted(keys):
                value = self._desired.get(key)
                ops.append(Delete(key) if value is None else Put(key, value, lease))
            await self._write(ops)
        except BaseException:
            self._dirty |= keys
            raise

    async def _full_resync(self, lease: int) -> None:
        self._dirty.clear()
        # Snapshot before any await so that later set()/delete() calls mark keys dirty again.
        desired = dict(self._desired)
        try:
            stale: list[bytes] = []
            for prefix in self.owned_prefixes:
                _, kvs = await self.client.get_prefix(prefix, keys_only=True)
                stale.extend(kv.key for kv in kvs if kv.key not in desired)
            ops: list[Put | Delete] = [Delete(k) for k in stale]
            ops += [Put(k, v, lease) for k, v in sorted(desired.items())]
            await self._write(ops)
        except BaseException:
            self._dirty |= set(desired)
            raise
        self._needs_full = False
        self.synced_lease = lease
        self.full_resyncs += 1
        if stale:
            logger.info("removed %d stale keys of a previous run from etcd", len(stale))

    async def _write(self, ops: list[Put | Delete]) -> None:
        for i in range(0, len(ops), TXN_MAX_OPS):
            await self.client.txn(ops[i:i + TXN_MAX_OPS])
            self.writes += 1
