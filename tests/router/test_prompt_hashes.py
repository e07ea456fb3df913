"""The router's memoized prompt hashing returns exactly the contract's hashes, from any memo state."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_stubs import encode_text

from index.hashing import block_hashes, namespace_seed
from router.prompt_hashes import PromptHasher

SEEDS = [namespace_seed(), namespace_seed("lora-a"), namespace_seed(None, "salt")]


@settings(max_examples=60, deadline=None)
@given(prefixes=st.lists(st.lists(st.integers(0, 2**32 - 1), max_size=300), min_size=1,
                         max_size=4),
       suffixes=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 300), max_size=90),
                                   st.sampled_from(SEEDS)), min_size=1, max_size=12),
       block_size=st.sampled_from([1, 4, 16]), max_chunks=st.sampled_from([1, 3, 1000]))
def test_hashes_equal_the_contract_whatever_the_memo_holds(
        prefixes: list[list[int]], suffixes: list[tuple[int, list[int], int]], block_size: int,
        max_chunks: int) -> None:
    hasher = PromptHasher(block_size, chunk_blocks=2, max_chunks=max_chunks)
    for which, tail, seed in suffixes:
        tokens = prefixes[which % len(prefixes)] + tail
        assert hasher.hashes(tokens, seed) == block_hashes(tokens, block_size, seed)
        assert len(hasher) <= max_chunks


def test_a_shared_prefix_is_hashed_once_and_the_tail_every_time() -> None:
    hasher = PromptHasher(16, chunk_blocks=8)
    system = "You are a careful assistant. Cite the context. " * 40  # ~120 blocks
    first = encode_text(system + "What is a KV cache?")
    assert hasher.hashes(first, 1337) == block_hashes(first, 16, 1337)
    chunks = (len(first) // 16) // 8
    assert (hasher.hits, hasher.misses) == (0, chunks)
    second = encode_text(system + "Why disaggregate prefill and decode?")
    assert hasher.hashes(second, 1337) == block_hashes(second, 16, 1337)
    shared_chunks = (len(system) + 1) // (16 * 8)  # +1: BOS
    assert hasher.hits == shared_chunks
    assert hasher.misses == chunks + (len(second) // 16) // 8 - shared_chunks
    # Another namespace never reads the first one's entries.
    other = namespace_seed("lora-a")
    assert hasher.hashes(second, other) == block_hashes(second, 16, other)
    assert hasher.hits == shared_chunks


def test_the_same_chunk_elsewhere_in_a_prompt_keeps_its_own_chain() -> None:
    hasher = PromptHasher(4, chunk_blocks=2)
    chunk = list(range(8))
    tokens = chunk * 3 + [9] * 4
    assert hasher.hashes(tokens, 1337) == block_hashes(tokens, 4, 1337)
    assert hasher.hashes(chunk * 2, 1337) == block_hashes(chunk * 2, 4, 1337)
    assert hasher.hits == 2


def test_the_memo_is_bounded() -> None:
    hasher = PromptHasher(4, chunk_blocks=1, max_chunks=10)
    rng = np.random.default_rng(1)
    for _ in range(50):
        tokens = rng.integers(0, 2**32, size=rng.integers(0, 60), dtype=np.uint64).tolist()
        assert hasher.hashes(tokens, 1337) == block_hashes(tokens, 4, 1337)
        assert len(hasher) <= 10


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1.5], [[1, 2]]])
def test_bad_token_ids_are_refused_as_the_contract_refuses_them(tokens: list[object]) -> None:
    with pytest.raises(ValueError):
        PromptHasher(1).hashes(tokens, 1337)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw", [{"block_size": 0}, {"block_size": 16, "chunk_blocks": 0},
                                {"block_size": 16, "max_chunks": 0}])
def test_bad_sizes_are_refused(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        PromptHasher(**kw)
