"""Prompt block hashes, memoized by chunk, so that a prefix many prompts share is hashed once.

Why: hashing is the largest piece of the router's own routing work (two xxh3 calls per block,
about 10 µs for a 900-token prompt), and the prompts a KV-aware router sees mostly begin with
what earlier prompts began with: system prompts, few-shot examples, a conversation's history.
A chunk's hashes depend only on its tokens, the hash before it and the namespace seed, so
``(seed, parent, chunk bytes)`` is an exact key: a hit returns the very hashes the engine
publishes, never an approximation.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from index.hashing import BASE_SEED, hash_token_bytes, token_bytes

CHUNK_BLOCKS = 8
"""Blocks per memoized chunk. Smaller chunks reuse more of a prompt that diverges mid-way; larger
ones cost fewer memo lookups. At 8, a lookup (hashing a 512-byte key) is ~4× cheaper than the
16 xxh3 calls it replaces."""

MAX_CHUNKS = 8192
"""Memo size bound: about 8 MB at 16-token blocks (a 512-byte key and 8 hashes per chunk)."""


MAX_ROUTED_BLOCKS = 16384
"""Blocks of a prompt that routing looks at: 262,144 tokens at 16 a block. The hashing, index
lookups and predictions of every block of a longer prompt would hold the event loop for seconds
(an 8 MiB prompt: 1.6 s, with health answers and etcd watches waiting); such a prompt is routed
on this much of its prefix, as a shorter one is on all of it."""


def routed_tokens(tokens: Any, block_size: int) -> Any:
    """The leading tokens routing hashes (all of them, but for a huge prompt)."""
    cap = MAX_ROUTED_BLOCKS * block_size
    return tokens[:cap] if len(tokens) > cap else tokens


class PromptHasher:
    """``index.hashing.block_hashes`` with a bounded memo of whole chunks of blocks."""

    def __init__(self, block_size: int, chunk_blocks: int = CHUNK_BLOCKS,
                 max_chunks: int = MAX_CHUNKS) -> None:
        if block_size < 1 or chunk_blocks < 1 or max_chunks < 1:
            raise ValueError("block_size, chunk_blocks and max_chunks must be >= 1, got "
                             f"{block_size}, {chunk_blocks}, {max_chunks}")
        self.block_size = block_size
        self.chunk_blocks = chunk_blocks
        self.max_chunks = max_chunks
        self._memo: dict[tuple[int, int | None, bytes], tuple[int, ...]] = {}
        self.hits = 0
        self.misses = 0

    def hashes(self, tokens: Sequence[int] | np.ndarray, seed: int) -> list[int]:
        """The chained hashes of the full blocks of ``tokens`` in namespace ``seed``."""
        data = token_bytes(tokens)
        step = 4 * self.block_size
        full = len(data) - len(data) % step
        chunk = step * self.chunk_blocks
        memo = self._memo
        out: list[int] = []
        parent: int | None = None
        off = 0
        while off + chunk <= full:
            piece = data[off:off + chunk]
            key = (seed, parent, piece)
            got = memo.get(key)
            if got is None:
                self.misses += 1
                got = tuple(hash_token_bytes(piece, self.block_size, seed, parent))
                if len(memo) >= self.max_chunks:
                    # Dropping everything is O(1) amortized, unlike evicting the oldest of a
                    # dict; the chunks still in use are back after one request each.
                    memo.clear()
                memo[key] = got
            else:
                self.hits += 1
            out.extend(got)
            parent = got[-1]
            off += chunk
        if off < full:
            out.extend(hash_token_bytes(data[off:full], self.block_size, seed, parent))
        return out

    def __len__(self) -> int:
        return len(self._memo)


_shared: dict[int, PromptHasher] = {}
_shared_lock = threading.Lock()


def shared_hasher(block_size: int) -> PromptHasher:
    """The process's one memoized hasher for ``block_size``: the policy's and the request
    parser's (large bodies are hashed in its threads), so that a prefix hashed on one path is
    a memo hit on the other. Safe across threads: a memo read or write is one dict operation,
    and a lost race only hashes a chunk twice (the result is the same)."""
    hasher = _shared.get(block_size)
    if hasher is None:
        with _shared_lock:
            hasher = _shared.setdefault(block_size, PromptHasher(block_size))
    return hasher


def prompt_hashes(tokens: Any, block_size: int) -> tuple[int, list[int]]:
    """(seed, hashes) of a base-model prompt by the shared memoized hasher: safe to call from
    any thread, as the request parser does for large bodies (``RouteContext.pre_hashed``)."""
    return BASE_SEED, shared_hasher(block_size).hashes(routed_tokens(tokens, block_size),
                                                       BASE_SEED)
