"""The lease an instance's block segments are written under.

Without ``--index-etcd`` that is the instance's own lease in the main etcd, the one its record
lives under: nothing more to open. With shards, it is a lease of its own in the etcd of the
instance's shard (``IndexShards.place``), held by its own ``LeaseSession``: the blocks vanish
with it when the instance dies, as the record vanishes with the main one. The two leases are
independent on purpose: a shard that is down costs the blocks' freshness, never the record
(routers keep routing the instance on load), and the main etcd being down does not stop the
blocks from being written.

Every writer of blocks (the index agent, the sidecar, the engine's prefill) opens one through
``index.pipeline``, so the rule is written once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from index.etcd import EtcdClient
from index.lease import LeaseSession, cancel_and_wait
from index.presence import revoke_within
from index.shards import IndexShards

logger = logging.getLogger(__name__)


class BlockSession:
    """``session``: where ``BlockWriter`` writes; ``shard``: which shard that is."""

    def __init__(self, main: LeaseSession, shards: IndexShards, instance_id: str) -> None:
        self.shard = shards.place(instance_id)
        settings = shards.clusters[self.shard] if shards.sharded else None
        self.client: EtcdClient | None = None
        self.session = main
        if settings is not None:
            self.client = EtcdClient(settings)
            self.session = LeaseSession(self.client, main.ttl)
        self.endpoint = settings.display if settings is not None else main.client.endpoint
        self._task: asyncio.Task[None] | None = None

    @property
    def own(self) -> bool:
        """True when the blocks have a lease of their own (a shard apart from the main etcd)."""
        return self.client is not None

    def start(self) -> None:
        """Hold the shard's lease in the background (nothing to do without shards). Never
        fails on etcd trouble: the lease loop retries, and the writer resyncs once it holds."""
        if self.client is not None and self._task is None:
            self._task = asyncio.create_task(self.session.run(), name="block-lease")

    async def close(self, revoke: bool = True) -> None:
        """Stop holding the shard's lease; ``revoke``: its blocks vanish now, else with the TTL."""
        if self.client is None:
            return
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if revoke:
            await revoke_within(self.session, what=f"block lease on index shard {self.shard} "
                                f"({self.endpoint})")
        with contextlib.suppress(Exception):
            await self.client.close()
