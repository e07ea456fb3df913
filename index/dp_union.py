"""The instance's block index over several DP groups: a block is the instance's while any DP group
holds it. Each group's KV events pass through its own ``InstanceIngestor`` (own sequence numbers,
own engine-hash map) into a :class:`DPUnionIndex` view, which writes to the one index writer only
when the first group gains a block or the last one drops it."""
from __future__ import annotations

from collections.abc import Sequence

from index.block_index import GPU, BlockIndex


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
