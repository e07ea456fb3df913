"""``CoreBlockTable``: ``BlockTable`` on the compiled core ``index._table_core`` (see ``index.table``).

The core is a dense array of entries, one per distinct block (its uint64 hash, then the bitmask
of the instance slots holding it), behind an open-addressing hash index of uint32 positions, plus
per-slot block counts (``index/_table_store.h``); its ``lookup`` walks a prompt in C,
prefetching the buckets of the blocks ahead, and builds the ``{instance: matched}`` dict itself.
Names, slots, media and the version stay in Python (``index.table_py.TableBase``), with the same
behaviour as the pure-Python table, except that hashes must be unsigned 64-bit ints (what
``index.hashing`` and segments produce): anything else raises ``TypeError`` or ``OverflowError``
instead of being stored.

``blocks`` and ``clear_instance`` scan the whole table (the core keeps no per-instance set: that
is where the pure table spends most of its memory); both are rare (a reload, an instance gone).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from index._table_core import Core
from index.table_py import GPU, TableBase


class CoreBlockTable(TableBase):
    """Blocks held per instance in the compiled core, with a fast longest-prefix lookup."""

    __slots__ = ("_core",)

    def __init__(self) -> None:
        super().__init__()
        self._core = Core()

    def _held_count(self, slot: int) -> int:
        return self._core.count(slot)

    def _holds(self, slot: int, h: int) -> bool:
        return self._core.holds(slot, h)

    def _held_blocks(self, slot: int) -> set[int]:
        return set(self._core.slot_blocks(slot))

    def apply_add(self, instance: str, hashes: Iterable[int], medium: str | None = GPU) -> None:
        """Record that ``instance`` holds ``hashes`` on ``medium`` (None means GPU)."""
        if not isinstance(hashes, list | tuple):
            hashes = list(hashes)
        if not hashes:
            return
        self._bump()
        slot = self._slot(instance)
        try:
            self._core.add(slot, hashes)
        finally:
            # A fresh slot that stored nothing (a hash was refused) must not stay interned.
            self._release_if_empty(slot)
        if self._media or (medium is not None and medium != GPU):
            self._set_media(slot, list(hashes), medium)

    def apply_remove(self, instance: str, hashes: Iterable[int]) -> None:
        """Forget ``hashes`` on ``instance``; hashes it does not hold are ignored."""
        slot = self._slots.get(instance)
        if slot is None:
            return
        self._bump()
        if self._media:
            hashes = list(hashes)
            # Media entries exist only for held blocks: drop them before the blocks go.
            for h in hashes:
                if self._core.holds(slot, h):
                    self._drop_medium(h, slot)
        self._core.remove(slot, hashes)
        self._release_if_empty(slot)

    def clear_instance(self, instance: str) -> int:
        """Forget every block of ``instance``; returns how many it held."""
        slot = self._slots.get(instance)
        if slot is None:
            return 0
        self._bump()
        if self._media:
            for per in self._media.values():
                per.pop(slot, None)
            self._media = {h: per for h, per in self._media.items() if per}
        n = self._core.clear_slot(slot)
        self._release_if_empty(slot)
        return n

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each instance holding ``hashes[0]``, how many leading blocks of ``hashes`` it holds."""
        return self._core.lookup(hashes, self._names)

    def __len__(self) -> int:
        return len(self._core)

    def entries(self) -> int:
        return self._core.entries()

    def memory(self) -> int:
        """Bytes the core allocated (the Python side not included)."""
        return self._core.memory()
