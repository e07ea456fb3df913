"""The instance's block index over several DP groups: a block is the instance's while any DP group
holds it. Each group's KV events pass through its own ``InstanceIngestor`` (own sequence numbers,
own engine-hash map) into a :class:`DPUnionIndex` view, which writes to the one index writer only
when the first group gains a block or the last one drops it."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

from index.block_index import GPU, BlockIndex
from index.events.ingest import InstanceIngestor
from index.events.subscriber import KVEventSubscriber, SubscriberConfig


class DPUnion:
    """Holders (DP ranks) per block hash, shared by the per-group views."""

    def __init__(self, target: BlockIndex) -> None:
        self.target = target
        self.holders: dict[int, set[int]] = {}

    def view(self, dp_rank: int) -> DPUnionIndex:
        return DPUnionIndex(self, dp_rank)


class DPUnionIndex(BlockIndex):
    def __init__(self, union: DPUnion, dp_rank: int) -> None:
        self.union, self.dp = union, dp_rank

    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = GPU) -> None:
        for h in hashes:
            self.union.holders.setdefault(h, set()).add(self.dp)
        # the writer's set semantics make re-adding a block another group holds a no-op
        await self.union.target.add(instance, parent, hashes, medium)

    async def remove(self, instance: str, hashes: Sequence[int]) -> None:
        gone = []
        for h in hashes:
            held = self.union.holders.get(h)
            if held is None:
                continue
            held.discard(self.dp)
            if not held:
                del self.union.holders[h]
                gone.append(h)
        if gone:
            await self.union.target.remove(instance, gone)

    async def clear(self, instance: str) -> None:
        mine = [h for h, held in self.union.holders.items() if self.dp in held]
        await self.remove(instance, mine)

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.union.target.lookup(hashes)

    def medium(self, instance: str, block_hash: int) -> str | None:
        return self.union.target.medium(instance, block_hash)

    def blocks(self, instance: str) -> set[int]:
        return {h for h, held in self.union.holders.items() if self.dp in held}

    def instances(self) -> set[str]:
        return self.union.target.instances()


async def subscribe_dp_ranks(union: DPUnion, instance_id: str,
                             sources: Sequence[tuple[int, SubscriberConfig]], block_size: int,
                             stack: contextlib.AsyncExitStack
                             ) -> list[tuple[InstanceIngestor, KVEventSubscriber]]:
    """One subscriber and ingestor per (DP rank, event source) into ``union``'s view of that
    rank; each closed with ``stack`` (registered before it starts: a bind that fails still
    closes its socket). Used by a prefill leader for its other DP groups and by a sidecar for
    every attention-DP rank of a foreign engine (SGLang publishes rank r on port + r)."""
    started = []
    for dp, config in sources:
        ingestor = InstanceIngestor(union.view(dp), instance_id, block_size=block_size,
                                    replay=config.replay_endpoint is not None)
        sub = KVEventSubscriber(config, ingestor)
        stack.push_async_callback(sub.close)
        await sub.start()
        started.append((ingestor, sub))
    return started
