"""The block-hash contract of docs/architecture.md, checked against hashes computed here from ``xxhash``
directly (the expected values never come from ``index.hashing`` itself).

The model is not part of the hash: it is part of the etcd key path
(``/kvatlas/v2/blocks/{model}/...``), so two models' identical token blocks hash the same and are
kept apart by the key layout instead. Only the LoRA name and the cache salt change the seed.
"""
from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from index.hashing import BASE_SEED, block_hashes, chain, namespace_seed


def ref_hashes(tokens: list[int], block_size: int, seed: int = 1337,
               parent: int | None = None) -> list[int]:
    """Reference implementation written from the DESIGN text, with struct + xxhash only."""
    out = []
    h = parent
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size:(i + 1) * block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *blk), seed)
        h = local if h is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", h, local), seed)
        out.append(h)
    return out


def ref_seed(lora: str, salt: str) -> int:
    return xxhash.xxh3_64_intdigest(lora.encode() + b"\x00" + salt.encode(), 1337)


def test_base_seed_is_1337() -> None:
    assert BASE_SEED == 1337
    assert namespace_seed() == 1337
    assert namespace_seed(None, None) == 1337


def test_pinned_sequences() -> None:
    seqs = [
        (list(range(16)), 16),
        (list(range(48)), 16),
        ([2**32 - 1, 0] * 8, 4),
        ([151_643] * 40, 8),
    ]
    for tokens, bs in seqs:
        got = block_hashes(tokens, bs)
        assert got == ref_hashes(tokens, bs)
        assert len(got) == len(tokens) // bs
    # First block of a base-model chain is Dynamo's compute_block_hash_for_seq: xxh3 of the
    # little-endian u32 tokens with seed 1337, no chaining.
    assert block_hashes(list(range(16)), 16)[0] == xxhash.xxh3_64_intdigest(
        b"".join(t.to_bytes(4, "little") for t in range(16)), 1337)


def test_chain_links_by_le_u64_pair() -> None:
    tokens = list(range(32))
    h0, h1 = block_hashes(tokens, 16)
    local1 = xxhash.xxh3_64_intdigest(struct.pack("<16I", *range(16, 32)), 1337)
    assert h1 == xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + local1.to_bytes(8, "little"), 1337)
    assert chain(h0, local1) == h1
    assert chain(None, local1) == local1


def test_namespace_changes_hashes() -> None:
    tokens = list(range(64))
    base = block_hashes(tokens, 16)
    lora = block_hashes(tokens, 16, namespace_seed("my-lora"))
    salted = block_hashes(tokens, 16, namespace_seed(None, "tenant-1"))
    both = block_hashes(tokens, 16, namespace_seed("my-lora", "tenant-1"))
    assert namespace_seed("my-lora") == ref_seed("my-lora", "")
    assert namespace_seed(None, "tenant-1") == ref_seed("", "tenant-1")
    assert namespace_seed("my-lora", "tenant-1") == ref_seed("my-lora", "tenant-1")
    assert lora == ref_hashes(tokens, 16, ref_seed("my-lora", ""))
    assert both == ref_hashes(tokens, 16, ref_seed("my-lora", "tenant-1"))
    all_first = {base[0], lora[0], salted[0], both[0]}
    assert len(all_first) == 4
    # The 0x00 separator keeps ("ab", "c") and ("a", "bc") apart.
    assert namespace_seed("ab", "c") != namespace_seed("a", "bc")


def test_partial_trailing_block_is_ignored() -> None:
    tokens = list(range(40))
    assert block_hashes(tokens, 16) == block_hashes(tokens[:32], 16)
    assert len(block_hashes(tokens, 16)) == 2
    assert block_hashes(tokens[:15], 16) == []
    assert block_hashes([], 16) == []


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 9), st.integers(0, 80))
def test_parent_continuation_equals_concatenation(tokens: list[int], bs: int, cut: int) -> None:
    cut = (min(cut, len(tokens)) // bs) * bs
    head = block_hashes(tokens[:cut], bs)
    tail = block_hashes(tokens[cut:], bs, parent=head[-1] if head else None)
    assert head + tail == block_hashes(tokens, bs) == ref_hashes(tokens, bs)


def test_numpy_input_matches_list() -> None:
    tokens = list(range(100, 164))
    for dtype in (np.int64, np.uint32, np.int32, np.uint64):
        assert block_hashes(np.asarray(tokens, dtype=dtype), 16) == ref_hashes(tokens, 16)


@pytest.mark.parametrize("tokens", [
    [1, 2, -1, 4],
    [1, 2, 2**32, 4],
    [2**64, 1, 2, 3],
    [-(2**63), 1, 2, 3],
    [1.5, 2, 3, 4],
    ["1", "2", "3", "4"],
    [True, False, True, False],
    [[1, 2], [3, 4]],
    [1, None, 3, 4],
    [-1, 2**63, 1, 2],
    [1, [2], 3, 4],
    5,
    None,
    "abcd",
])
def test_bad_tokens_raise_value_error(tokens: list) -> None:
    with pytest.raises(ValueError):
        block_hashes(tokens, 2)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2, 3], 0)
