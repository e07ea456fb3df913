"""The ``BlockIndex`` interface: which instance holds which chained prefix blocks.

Keys are kvatlas's own chained block hashes (``index.hashing``) of one model namespace, so a
block hash identifies its whole prefix and a lookup only has to walk the prompt's blocks in order.
Backends: ``tests/memory_index.py`` (in-process) and ``tests/etcd_block_index.py`` (a per-instance
etcd writer plus a watched mirror), the references the test suites check ingestion and the mirror
against; no service writes through ``BlockIndex`` (they write a ``BlockSink``, the
``BlockWriter`` of ``index/pipeline.py``). One contract test suite runs against both.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

GPU = "GPU"
_MEDIUM_RE = re.compile(r"[A-Za-z0-9_.-]{1,32}")


def valid_medium(medium: object) -> bool:
    """A medium name the etcd value format can carry: 1-32 ASCII letters, digits or ``_.-``."""
    return isinstance(medium, str) and _MEDIUM_RE.fullmatch(medium) is not None


class BlockSink(Protocol):
    """Where one instance's ingestion writes: synchronous, in memory, no instance argument (the
    sink is that instance's). ``index.writer.BlockWriter`` is one (it coalesces the changes and
    writes them to etcd in the background); ``index.dp_union.DPUnion``'s views are others."""

    def add(self, parent: int | None, hashes: Sequence[int], medium: str = GPU) -> None:
        """The instance holds ``hashes`` (consecutive blocks after ``parent``) on ``medium``."""

    def remove(self, hashes: Sequence[int]) -> None:
        """The instance no longer holds ``hashes``; unknown ones are ignored."""

    def clear(self) -> None:
        """The instance holds nothing."""


class BlockIndex(ABC):
    """Per-model index of prefix blocks held by each instance."""

    @abstractmethod
    async def add(self, instance: str, parent: int | None, hashes: Sequence[int],
                  medium: str = GPU) -> None:
        """Record that ``instance`` holds ``hashes`` (consecutive blocks after ``parent``)."""

    @abstractmethod
    async def remove(self, instance: str, hashes: Sequence[int]) -> None:
        """Forget ``hashes`` on ``instance``; unknown hashes are ignored."""

    @abstractmethod
    async def clear(self, instance: str) -> None:
        """Forget every block of ``instance``."""

    @abstractmethod
    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each instance holding ``hashes[0]``, how many leading blocks of ``hashes`` it holds.

        O(len(hashes)) with an early exit once no instance matches further. Instances with no
        match are left out.
        """

    @abstractmethod
    def medium(self, instance: str, block_hash: int) -> str | None:
        """Where ``instance`` holds ``block_hash`` ("GPU", "CPU", ...), or None if it does not."""

    @abstractmethod
    def blocks(self, instance: str) -> set[int]:
        """Every block hash ``instance`` holds (for tests, stats and resync)."""

    @abstractmethod
    def instances(self) -> set[str]:
        """Instances holding at least one block."""
