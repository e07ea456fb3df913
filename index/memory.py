"""In-process ``BlockIndex`` backend: a thin async wrapper around ``index.table.BlockTable``.

Used by a single router without etcd, by tests, and as the reference the etcd backend is checked
against. Writes are applied at once, so a read after an awaited write always sees it.
"""
from __future__ import annotations

from collections.abc import Sequence

from index.block_index import GPU, BlockIndex
from index.table import BlockTable


class MemoryBlockIndex(BlockIndex):
    """Per-model index of prefix blocks held by each instance, kept in this process only."""

    def __init__(self) -> None:
        self.table = BlockTable()

    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = GPU) -> None:
        # ``parent`` is implied by the chained hashes themselves: a block hash identifies its
        # whole prefix, so the table does not need it.
        self.table.apply_add(instance, hashes, medium)

    async def remove(self, instance: str, hashes: Sequence[int]) -> None:
        self.table.apply_remove(instance, hashes)

    async def clear(self, instance: str) -> None:
        self.table.clear_instance(instance)

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.table.lookup(hashes)

    def lookup_detailed(self, hashes: Sequence[int]) -> dict[str, tuple[int, int]]:
        """``{instance: (matched, gpu_matched)}``; see ``BlockTable.lookup_detailed``."""
        return self.table.lookup_detailed(hashes)

    def medium(self, instance: str, h: int) -> str | None:
        """The medium ``instance`` holds block ``h`` on, or None when it does not hold it."""
        return self.table.medium(instance, h)

    def blocks(self, instance: str) -> set[int]:
        return self.table.blocks(instance)

    def instances(self) -> set[str]:
        return self.table.instances()
