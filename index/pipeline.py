"""One instance's block pipeline: KV events -> ingestion -> DP union -> writer -> shard lease.

::

    KVEventSubscriber --> InstanceIngestor --> DPUnion view --> BlockWriter --> etcd
    (one per DP rank)     (own hashes)        (a block is the     (coalesced txns under the
    local feed (engine) -/                     instance's while    BlockSession's lease: the
                                               any rank holds it)  instance's, or its shard's)

Every process that indexes an instance (the index agent, the sidecar, a PD prefill's leader)
opens it here, so the parts are wired and started in one order and stopped in its reverse:

- start: the shard lease (``BlockSession``), the writer, then the subscribers (binding their
  sockets) — nothing feeds the writer before it runs;
- close: the subscribers (no more events), the writer (no more writes), then the shard lease
  (revoked: the blocks vanish now; or left to expire, as a crash would).

Ingestion writes to a synchronous ``BlockSink`` (the writer, or a DP union's view of it): the
writer only coalesces in memory, and its background task writes to etcd.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from index.block_index import BlockSink
from index.dp_union import DPUnion
from index.events.ingest import InstanceIngestor
from index.events.subscriber import KVEventSubscriber, SubscriberConfig
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.shard_session import BlockSession
from index.shards import IndexShards
from index.writer import BlockWriter, BlockWriterConfig

logger = logging.getLogger(__name__)


class BlockPipeline:
    """The parts of one instance's pipeline (built, not started: see ``start``/``close``).

    ``sources``: (DP rank, where its KV events come from), one subscriber each. ``local``: also
    an ingestor for DP rank 0 fed in process (``local``; a prefill's own prefix cache), which
    the caller feeds. With one event stream in all the ingestor writes to the writer itself;
    with several, each through its rank's view of a ``DPUnion``.
    """

    def __init__(self, session: LeaseSession, shards: IndexShards, layout: KeyLayout, model: str,
                 instance_id: str, *, block_size: int,
                 sources: Sequence[tuple[int, SubscriberConfig]] = (), local: bool = False,
                 writer_config: BlockWriterConfig | None = None) -> None:
        self.instance_id = instance_id
        self.blocks = BlockSession(session, shards, instance_id)
        self.writer = BlockWriter(self.blocks.session, layout, model, instance_id,
                                  writer_config or BlockWriterConfig())
        streams = len(sources) + (1 if local else 0)
        self.union: DPUnion | None = DPUnion(self.writer) if streams > 1 else None
        self.local: InstanceIngestor | None = None
        if local:
            self.local = InstanceIngestor(self.sink(0), instance_id, block_size=block_size)
        # Built here, started by start(): one ingestor and subscriber per event source.
        self.subscribed: list[tuple[InstanceIngestor, KVEventSubscriber]] = []
        for dp, config in sources:
            ingestor = InstanceIngestor(self.sink(dp), instance_id, block_size=block_size,
                                        replay=config.replay_endpoint is not None)
            self.subscribed.append((ingestor, KVEventSubscriber(config, ingestor)))
        self.writer_task: asyncio.Task[None] | None = None
        self._subs = contextlib.AsyncExitStack()

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks that must stay alive while the pipeline runs (its writer's), for a caller
        that watches its own tasks, as ``InstancePresence.tasks``."""
        return [self.writer_task] if self.writer_task is not None else []

    def sink(self, dp_rank: int) -> BlockSink:
        """Where DP rank ``dp_rank``'s ingestion writes."""
        return self.union.view(dp_rank) if self.union is not None else self.writer

    @property
    def ingestors(self) -> list[InstanceIngestor]:
        """Every ingestor, the local one first."""
        own = [self.local] if self.local is not None else []
        return own + [i for i, _ in self.subscribed]

    @property
    def subscribers(self) -> list[KVEventSubscriber]:
        return [s for _, s in self.subscribed]

    async def start(self) -> None:
        """Shard lease, writer, then subscribers; a subscriber that cannot bind or connect
        raises (``zmq.ZMQError``) with the ones before it closed — call ``close()`` then."""
        self.blocks.start()
        if self.blocks.own:
            logger.info("instance %s writes its blocks to index shard %d (%s)",
                        self.instance_id, self.blocks.shard, self.blocks.endpoint)
        self.writer_task = self.writer.start()
        for _, sub in self.subscribed:
            # Registered before it starts: a bind that fails still closes its socket.
            self._subs.push_async_callback(sub.close)
            await sub.start()

    async def close(self, revoke: bool = True) -> None:
        """Subscribers, writer, then the shard lease (``revoke``: its blocks vanish now, else
        with its TTL). Harmless twice, and after a failed or no start."""
        await self._subs.aclose()
        await self.writer.close()
        self.writer_task = None
        await self.blocks.close(revoke)


async def open_block_pipeline(stack: contextlib.AsyncExitStack, session: LeaseSession,
                              shards: IndexShards, layout: KeyLayout, model: str,
                              instance_id: str, *, block_size: int,
                              sources: Sequence[tuple[int, SubscriberConfig]] = (),
                              local: bool = False,
                              writer_config: BlockWriterConfig | None = None) -> BlockPipeline:
    """A started ``BlockPipeline`` closed (and its shard lease revoked) with ``stack``; closed
    again at once when its start fails. Open it after the presence whose lease ``session`` is,
    so the stack stops the pipeline's writer before that lease is revoked."""
    pipeline = BlockPipeline(session, shards, layout, model, instance_id, block_size=block_size,
                             sources=sources, local=local, writer_config=writer_config)
    stack.push_async_callback(pipeline.close)
    await pipeline.start()
    return pipeline
