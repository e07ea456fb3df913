"""The etcd-backed ``BlockIndex``: a ``BlockWriter`` per instance plus one watched ``BlockMirror``.

Writes go to the writer of the instance (its own lease, or a session the caller attaches, e.g. the
one the instance's bootstrap mirror already holds). Reads answer from the mirror, so they are
eventually consistent: a block added here shows up in ``lookup`` once the writer has flushed it
and the watch has delivered it (milliseconds). ``settle()`` waits for exactly that, which is what
tests and the contract suite use after each change.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from index.block_index import GPU, BlockIndex
from index.errors import EtcdError
from index.etcd import EtcdClient
from index.keys import KeyLayout, validate_instance_id, validate_model
from index.lease import LeaseSession, cancel_and_wait
from index.mirror import BlockMirror, BlockMirrorConfig
from index.writer import BlockWriter, BlockWriterConfig

logger = logging.getLogger(__name__)


_MAX_GONE = 10_000
"""Dropped instances remembered for ``settle()`` at most."""


class IndexNotSettled(EtcdError):
    """The mirror did not catch up with the writers in time; etcd is slow or unreachable."""


class EtcdBlockIndex(BlockIndex):
    """Block index of one model kept in etcd. ``await start()`` before use, ``close()`` after."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, model: str, *, lease_ttl: int = 10,
                 writer_config: BlockWriterConfig | None = None,
                 mirror_config: BlockMirrorConfig | None = None) -> None:
        self.client = client
        self.layout = layout
        self.model = validate_model(model)
        self.lease_ttl = lease_ttl
        self.writer_config = writer_config or BlockWriterConfig()
        self.mirror = BlockMirror(client, layout, model, mirror_config)
        self.writers: dict[str, BlockWriter] = {}
        self._own_sessions: dict[str, tuple[LeaseSession, asyncio.Task[None]]] = {}
        # For settle(): the newest revision any dropped writer wrote, and instances whose keys
        # go with a revoked or expiring lease (their deletes have no revision we know of).
        self._dropped_revision = 0
        self._gone: dict[str, None] = {}  # insertion-ordered set, oldest first

    async def start(self, timeout: float = 10.0) -> None:
        self.mirror.start()
        if not await self.mirror.wait_ready(timeout):
            raise IndexNotSettled(f"block mirror did not load within {timeout} s",
                                  endpoint=self.client.endpoint, op="get_prefix")

    async def close(self, revoke: bool = True) -> None:
        """Stop writers and mirror; with ``revoke`` this index's leases go (and their keys)."""
        for instance in list(self.writers):
            await self.drop(instance, revoke=revoke)
        await self.mirror.close()

    # --- writers ----------------------------------------------------------------------------

    def attach(self, instance: str, session: LeaseSession) -> BlockWriter:
        """Write ``instance``'s blocks under ``session`` (run by the caller)."""
        validate_instance_id(instance)
        if instance in self.writers:
            raise ValueError(f"instance {instance!r} already has a block writer")
        writer = BlockWriter(session, self.layout, self.model, instance, self.writer_config)
        writer.start()
        self.writers[instance] = writer
        return writer

    def writer(self, instance: str, lease_ttl: int | None = None) -> BlockWriter:
        """The writer of ``instance``, created with a lease of its own on first use (of
        ``lease_ttl`` seconds, ``self.lease_ttl`` by default; ignored for an existing writer)."""
        writer = self.writers.get(instance)
        if writer is None:
            validate_instance_id(instance)
            session = LeaseSession(self.client, lease_ttl or self.lease_ttl)
            task = asyncio.create_task(session.run(), name=f"lease-{instance}")
            self._own_sessions[instance] = (session, task)
            writer = self.attach(instance, session)
        return writer

    async def drop(self, instance: str, revoke: bool = True) -> None:
        """Stop writing ``instance``. With ``revoke`` its lease is revoked and etcd deletes its
        keys now; without, an own lease simply stops being refreshed and expires (instance death).

        Closing the writer cancels its transactions in flight, which etcd may apply all the same
        at a revision nobody learns. With ``revoke`` the revoke's own revision bounds them (one
        applied before it lost its keys at it; one arriving after it fails: no lease), so
        ``settle()`` waits for the mirror to reach that. Without, ``settle()`` only waits for the
        instance to leave the mirror: settle before dropping it, as a writer that vanishes with
        nothing in flight."""
        writer = self.writers.pop(instance, None)
        if writer is None:
            return
        await writer.close()
        self._dropped_revision = max(self._dropped_revision, writer.last_revision)
        self._gone.pop(instance, None)
        self._gone[instance] = None
        self._prune_gone()
        own = self._own_sessions.pop(instance, None)
        if own is not None:
            session, task = own
            await cancel_and_wait(task)
            if revoke:
                revision = await session.revoke()
                self._dropped_revision = max(self._dropped_revision, revision)

    def _prune_gone(self) -> None:
        """Keep ``_gone`` bounded without ``settle()``: forget dropped instances whose keys the
        mirror has already seen go, and past ``_MAX_GONE`` the oldest (settle() then merely
        stops waiting for those)."""
        if self.mirror.revision >= self._dropped_revision:
            mirrored = self.mirror.instances()
            for instance in [i for i in self._gone
                             if i not in mirrored and i not in self.writers]:
                del self._gone[instance]
        while len(self._gone) > _MAX_GONE:
            del self._gone[next(iter(self._gone))]

    # --- BlockIndex -------------------------------------------------------------------------

    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = GPU) -> None:
        self.writer(instance).add(parent, hashes, medium)

    async def remove(self, instance: str, hashes: Sequence[int]) -> None:
        writer = self.writers.get(instance)
        if writer is not None:
            writer.remove(hashes)

    async def clear(self, instance: str) -> None:
        writer = self.writers.get(instance)
        if writer is not None:
            writer.clear()

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.mirror.lookup(hashes)

    def lookup_detailed(self, hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """``{instance: (matched, leading matched blocks on the GPU)}``."""
        return self.mirror.table().lookup_detailed(hashes)

    def medium(self, instance: str, h: int) -> str | None:
        """The medium ``instance`` holds block ``h`` on (as mirrored), or None."""
        return self.mirror.table().medium(instance, h)

    def blocks(self, instance: str) -> set[int]:
        return self.mirror.blocks(instance)

    def instances(self) -> set[str]:
        return self.mirror.instances()

    # --- consistency ------------------------------------------------------------------------

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until every writer has flushed and the mirror has applied etcd up to now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for writer in list(self.writers.values()):
            if not await writer.wait_synced(max(0.0, deadline - loop.time())):
                raise IndexNotSettled(
                    f"block writer of {writer.instance_id} not synced within {timeout} s "
                    f"(state {writer.state}, {writer.pending} pending, last error "
                    f"{writer.last_error})", endpoint=self.client.endpoint, op="txn")
        target = max([self._dropped_revision, *(w.last_revision for w in self.writers.values())])
        if not await self.mirror.wait_revision(target, max(0.0, deadline - loop.time())):
            raise IndexNotSettled(
                f"block mirror at revision {self.mirror.revision}, not {target}, after {timeout} s",
                endpoint=self.client.endpoint, op="watch")
        # A dropped instance that has not written since: its keys leave with its lease.
        for instance in list(self._gone):
            writer = self.writers.get(instance)
            if writer is not None and len(writer):
                self._gone.pop(instance, None)  # its own writes (ordered after the drop) cover it
                continue
            while instance in self.mirror.instances():
                if loop.time() > deadline:
                    raise IndexNotSettled(
                        f"blocks of dropped instance {instance} still mirrored after {timeout} s",
                        endpoint=self.client.endpoint, op="watch")
                await asyncio.sleep(0.01)
            if writer is None:
                self._gone.pop(instance, None)

    wait_caught_up = settle
