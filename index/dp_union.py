"""The instance's block index over several DP groups: a block is the instance's while any DP group
holds it. Each group's KV events pass through its own ``InstanceIngestor`` (own sequence numbers,
own engine-hash map) into a :class:`DPUnionView` (a synchronous ``BlockSink``), which writes to
the one index writer only when the first group gains a block or the last one drops it."""
from __future__ import annotations

from collections.abc import Sequence

from index.block_index import GPU, BlockSink


class DPUnion:
    """Holders (DP ranks) per block hash, shared by the per-group views."""

    def __init__(self, target: BlockSink) -> None:
        self.target = target
        self.holders: dict[int, set[int]] = {}

    def view(self, dp_rank: int) -> DPUnionView:
        return DPUnionView(self, dp_rank)


class DPUnionView:
    """DP group ``dp_rank``'s ``BlockSink``: passes a block on to the union's target only when
    the first group gains it or the last one drops it."""

    def __init__(self, union: DPUnion, dp_rank: int) -> None:
        self.union, self.dp = union, dp_rank

    def add(self, parent: int | None, hashes: Sequence[int], medium: str = GPU) -> None:
        for h in hashes:
            self.union.holders.setdefault(h, set()).add(self.dp)
        # the writer's set semantics make re-adding a block another group holds a no-op
        self.union.target.add(parent, hashes, medium)

    def remove(self, hashes: Sequence[int]) -> None:
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
            self.union.target.remove(gone)

    def clear(self) -> None:
        self.remove([h for h, held in self.union.holders.items() if self.dp in held])

    def blocks(self) -> set[int]:
        return {h for h, held in self.union.holders.items() if self.dp in held}
