"""In-process ``BlockIndex`` backend: a thin async wrapper around ``index.table.BlockTable``.

The tests' reference: the etcd backend, the ingestor and the mirror are checked against it.
Writes are applied at once, so a read after an awaited write always sees it.
"""
from __future__ import annotations

import time
from collections.abc import Hashable, Sequence

from index.block_index import GPU, BlockIndex
from index.keys import validate_model
from index.reader import IndexReader, IndexStatus, InstanceDetail
from index.table import BlockTable
from index.tiers import TierMatch

DEFAULT_MODEL = "default"
"""The model an index built without one answers for (``IndexReader.match``)."""


class MemoryBlockIndex(BlockIndex, IndexReader):
    """Per-model index of prefix blocks held by each instance, kept in this process only."""

    ready = True
    """Always: there is nothing to load, every write is applied at once."""

    def __init__(self, model: str = DEFAULT_MODEL) -> None:
        self.model = validate_model(model)
        self.table = BlockTable()
        self._changed: dict[str, float] = {}

    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = GPU) -> None:
        # ``parent`` is implied by the chained hashes themselves: a block hash identifies its
        # whole prefix, so the table does not need it.
        self.table.apply_add(instance, hashes, medium)
        self._touched(instance)

    async def remove(self, instance: str, hashes: Sequence[int]) -> None:
        self.table.apply_remove(instance, hashes)
        self._touched(instance)

    async def clear(self, instance: str) -> None:
        self.table.clear_instance(instance)
        self._touched(instance)

    def _touched(self, instance: str) -> None:
        if self.table.count(instance):
            self._changed[instance] = time.time()
        else:
            self._changed.pop(instance, None)

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

    # --- IndexReader ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return True

    def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        return self.table.lookup(hashes) if model == self.model else {}

    def match_tiers(self, model: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        return self.table.lookup_tiers(hashes) if model == self.model else {}

    def version(self, model: str | None = None) -> Hashable:
        return self.table.version if model is None or model == self.model else 0

    def models(self) -> frozenset[str]:
        return frozenset((self.model,))

    def block_count(self, model: str | None = None) -> int:
        return len(self.table) if model is None or model == self.model else 0

    def instance_ids(self) -> frozenset[str]:
        return frozenset(self.table.instances())

    def instance(self, instance_id: str) -> InstanceDetail | None:
        n = self.table.count(instance_id)
        if not n:
            return None
        return InstanceDetail(instance_id, {self.model: n}, self._changed.get(instance_id, 0.0))

    def status(self) -> IndexStatus:
        return IndexStatus(ready=True, connected=True, blocks=len(self.table))
