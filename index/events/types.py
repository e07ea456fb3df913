"""KV cache events as plain data, independent of any I/O (the engine appends them, a publisher
drains them, the indexer consumes them). Field names follow vLLM's ``KVEventBatch``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks added to a prefix cache. Hashes are the engine's own (not trusted as index keys)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    """Per-block extra hash inputs (multimodal content hashes, cache salt, ...), or None."""

    @property
    def has_extra_keys(self) -> bool:
        """True when any block carries extra hash inputs (a null or empty entry carries none)."""
        return bool(self.extra_keys) and any(k not in (None, [], ()) for k in self.extra_keys)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from a prefix cache, by engine hash."""

    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
