"""The block-hash contract of docs/architecture.md (shared by engine, index and router).

Full blocks of ``block_size`` tokens only. ``local_i = xxh3_64(tokens of block i as little-endian
uint32, seed)``; ``h_0 = local_0``; ``h_i = xxh3_64(le_u64(h_{i-1}) || le_u64(local_i), seed)``.
``seed = 1337`` for a base model; with a LoRA name or cache salt,
``seed = xxh3_64(utf8(lora_name) || 0x00 || utf8(cache_salt), 1337)``. For a base model ``local_i``
equals NVIDIA Dynamo's ``compute_block_hash_for_seq``, so hashes can be checked against it.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

BASE_SEED = 1337
DEFAULT_BLOCK_SIZE = 16
MAX_TOKEN_ID = 2**32 - 1

_xxh3 = xxhash.xxh3_64_intdigest
_pair = struct.Struct("<QQ")


def namespace_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The hash seed of a namespace: 1337 for a base model, else derived from LoRA name and salt."""
    if not lora_name and not cache_salt:
        return BASE_SEED
    data = (lora_name or "").encode() + b"\x00" + (cache_salt or "").encode()
    return _xxh3(data, BASE_SEED)


_U32 = np.dtype("<u4")


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The hashed form of ``tokens``: little-endian uint32s; ValueError on ids out of range."""
    if isinstance(tokens, np.ndarray) and tokens.dtype == _U32 and tokens.ndim == 1:
        # The router's own encoding: every value is in range by construction, skip the scans.
        return tokens.tobytes()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must be integers in the uint32 range [0, 2^32-1]")
    return arr.astype("<u4", copy=False).tobytes()


def chain(parent: int | None, local: int, seed: int = BASE_SEED) -> int:
    """One link of the chain: the hash of a block whose own-token hash is ``local``."""
    if parent is None:
        return local
    return _xxh3(_pair.pack(parent, local), seed)


def block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int = DEFAULT_BLOCK_SIZE,
                 seed: int = BASE_SEED, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``; a partial trailing block is ignored.

    ``parent`` continues a chain: the hash of the block just before ``tokens[0]``.
    """
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    return hash_token_bytes(token_bytes(tokens), block_size, seed, parent)


def hash_token_bytes(data: bytes, block_size: int, seed: int = BASE_SEED,
                     parent: int | None = None) -> list[int]:
    """``block_hashes`` of tokens already in their hashed form (see ``token_bytes``)."""
    step = 4 * block_size
    full = len(data) - len(data) % step
    if not full:
        return []
    xxh3, pack = _xxh3, _pair.pack
    local_hashes = [xxh3(data[off:off + step], seed) for off in range(0, full, step)]
    if parent is None:
        h = local_hashes[0]
        out = [h]
        rest = local_hashes[1:]
    else:
        h = parent
        out = []
        rest = local_hashes
    append = out.append
    for local in rest:
        h = xxh3(pack(h, local), seed)
        append(h)
    return out
