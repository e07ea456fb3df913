"""``ShardedIndex``: the block index spread over several etcd clusters, read as one.

A router started with ``--index-etcd`` follows every shard with a ``BlockMirror`` of its own (one
etcd client each) and answers through this class, which is an ``IndexReader`` like a single
mirror. An instance's blocks live on one shard (``index.shards``), so a match is the union of the
shards' matches; should an instance show up on two (it moved, and its old lease has not expired
yet), its longer match counts.

Shards fail alone. A shard whose etcd is unreachable keeps serving its last known state, and is
``stale`` in ``shards()``; a shard never loaded adds nothing until it loads. The whole index is
``ready`` as soon as one shard has loaded, so that a router never routes on load alone because
one shard of many is down, and ``connected`` only while every shard is.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Sequence

from index.errors import EtcdError
from index.etcd import EtcdClient
from index.keys import KeyLayout
from index.mirror import BlockMirror
from index.reader import IndexReader, IndexStatus, InstanceDetail, ShardStatus
from index.shards import IndexShards
from index.tiers import TierMatch

logger = logging.getLogger(__name__)


class ShardedIndex(IndexReader):
    """Every shard's ``BlockMirror``, in shard order, read as one index."""

    def __init__(self, mirrors: Sequence[BlockMirror]) -> None:
        if not mirrors:
            raise ValueError("a sharded index needs at least one shard")
        models = {m.model for m in mirrors}
        if len(models) != 1:
            raise ValueError(f"every shard's mirror must follow the same model, got {models}")
        self.mirrors = list(mirrors)
        self.model = mirrors[0].model

    # ``IndexReader.ready`` is an attribute there; here it follows the shards.
    @property  # type: ignore[override]
    def ready(self) -> bool:
        return any(m.ready for m in self.mirrors)

    @property
    def connected(self) -> bool:
        return all(m.connected for m in self.mirrors)

    def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.mirrors:
            if not m.ready:
                continue
            found = m.match(model, hashes)
            if not found:
                continue
            if not out:
                out = found
                continue
            for name, n in found.items():
                if n > out.get(name, 0):
                    out[name] = n
        return out

    def match_tiers(self, model: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        out: dict[str, TierMatch] = {}
        for m in self.mirrors:
            if not m.ready:
                continue
            for name, t in m.match_tiers(model, hashes).items():
                have = out.get(name)
                if have is None or t.blocks > have.blocks:
                    out[name] = t
        return out

    def version(self, model: str | None = None) -> Hashable:
        # A shard not yet loaded has empty tables (version 0) and loading one with blocks gives
        # it a new table version: the shards' versions together say everything.
        versions = tuple(m.version(model) for m in self.mirrors)
        return versions if any(versions) else 0

    def models(self) -> frozenset[str]:
        return frozenset().union(*(m.models() for m in self.mirrors))

    def block_count(self, model: str | None = None) -> int:
        # Summed over shards: a block held by instances on two shards counts twice.
        return sum(m.block_count(model) for m in self.mirrors)

    def instance_ids(self) -> frozenset[str]:
        return frozenset().union(*(m.instance_ids() for m in self.mirrors))

    def instance(self, instance_id: str) -> InstanceDetail | None:
        found = [d for m in self.mirrors if (d := m.instance(instance_id)) is not None]
        if not found:
            return None
        if len(found) == 1:
            return found[0]
        blocks: dict[str, int] = {}
        for d in found:
            for model, n in d.blocks.items():
                blocks[model] = max(n, blocks.get(model, 0))
        return InstanceDetail(instance_id, blocks, max(d.changed_at for d in found))

    def status(self) -> IndexStatus:
        sts = [m.status() for m in self.mirrors]
        errors = [f"shard {i}: {st.last_error}" for i, st in enumerate(sts) if st.last_error]
        # Revisions of different clusters do not compare: the whole index has none.
        return IndexStatus(ready=self.ready, connected=self.connected,
                           blocks=sum(st.blocks for st in sts), revision=0,
                           revision_lag=max(st.revision_lag for st in sts),
                           disconnects=sum(st.disconnects for st in sts),
                           last_error="; ".join(errors) or None)

    def shards(self) -> list[ShardStatus]:
        return [ShardStatus(i, m.client.endpoint, m.status(), len(m.instance_ids()))
                for i, m in enumerate(self.mirrors)]


async def open_reader(stack: contextlib.AsyncExitStack, client: EtcdClient, layout: KeyLayout,
                      model: str | None, shards: IndexShards) -> IndexReader:
    """The read side of the block index, started and closed with ``stack``: a ``BlockMirror``
    of ``client``'s etcd, or (``shards`` sharded, ``--index-etcd``) one mirror per shard, each
    on its own client, read as one ``ShardedIndex``. etcd away is no error: each mirror's loop
    connects later (``model``: the one model to follow, None for all)."""
    if not shards.sharded:
        mirror = BlockMirror(client, layout, model)
        stack.push_async_callback(mirror.close)
        mirror.start()
        return mirror
    mirrors = []
    for i, settings in enumerate(shards.clusters):
        shard_client = EtcdClient(settings)
        stack.push_async_callback(shard_client.close)
        try:
            await shard_client.connect()
        except EtcdError as exc:
            logger.warning("index shard %d (%s) not reachable at start (%s); its mirror "
                           "retries in the background", i, settings.display, exc)
        mirror = BlockMirror(shard_client, layout, model)
        stack.push_async_callback(mirror.close)
        mirror.start()
        mirrors.append(mirror)
    logger.info("following the block index on %d shards: %s", len(mirrors), shards.describe())
    return ShardedIndex(mirrors)
