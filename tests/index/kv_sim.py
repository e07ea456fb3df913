"""Test helpers: an engine-like source of KV events with foreign engine hashes (not collected)."""
from __future__ import annotations

import hashlib
from typing import Literal

from index.events.codec import decode_payload, encode_payload
from index.events.types import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from index.hashing import block_hashes

HashStyle = Literal["signed", "unsigned", "bytes"]


class SimEngine:
    """Produces BlockStored/BlockRemoved the way vLLM (one event per run of full blocks) or SGLang
    (one event per page, chained by parent) does, with engine hashes unlike ours."""

    def __init__(self, block_size: int = 4, style: HashStyle = "signed", salt: bytes = b"run1") -> None:
        self.bs = block_size
        self.style = style
        self.salt = salt

    def engine_hash(self, parent: int | bytes | None, tokens: list[int]) -> int | bytes:
        d = hashlib.sha256(self.salt + repr((parent, tokens)).encode()).digest()
        if self.style == "bytes":
            return d
        if self.style == "signed":
            return int.from_bytes(d[:8], "big", signed=True)  # SGLang truncates SHA-256 to int64
        return int.from_bytes(d[:8], "big")

    def chain(self, tokens: list[int]) -> list[int | bytes]:
        out: list[int | bytes] = []
        parent = None
        for i in range(len(tokens) // self.bs):
            parent = self.engine_hash(parent, tokens[i * self.bs:(i + 1) * self.bs])
            out.append(parent)
        return out

    def vllm_store(self, tokens: list[int], start_block: int = 0, medium: str | None = None) -> BlockStored:
        """Blocks ``start_block..`` of ``tokens`` (full blocks only), as one event."""
        full = len(tokens) // self.bs
        hs = self.chain(tokens)
        return BlockStored(
            block_hashes=hs[start_block:full],  # type: ignore[arg-type]
            parent_block_hash=hs[start_block - 1] if start_block else None,  # type: ignore[arg-type]
            token_ids=tokens[start_block * self.bs:full * self.bs],
            block_size=self.bs, medium=medium)

    def sglang_store(self, tokens: list[int]) -> list[BlockStored]:
        """One event per page, a partial last page included (with its smaller block_size)."""
        out = []
        parent = None
        for off in range(0, len(tokens), self.bs):
            page = tokens[off:off + self.bs]
            h = self.engine_hash(parent, page)
            out.append(BlockStored(block_hashes=[h], parent_block_hash=parent,  # type: ignore[list-item]
                                   token_ids=page, block_size=len(page)))
            parent = h  # type: ignore[assignment]
        return out

    def remove(self, tokens: list[int], blocks: list[int]) -> BlockRemoved:
        hs = self.chain(tokens)
        return BlockRemoved(block_hashes=[hs[i] for i in blocks])  # type: ignore[misc]


def norm(h: int | bytes) -> int:
    """The codec's normalisation of an engine hash to uint64."""
    if isinstance(h, bytes):
        return int.from_bytes(h[-8:], "big")
    return h & (2**64 - 1)


def own(tokens: list[int], bs: int) -> list[int]:
    return block_hashes(tokens, bs)


def branching_prompts(bs: int) -> list[list[int]]:
    """Three prompts sharing leading blocks, so that chains branch and share parents."""
    return [list(range(6 * bs)), list(range(2 * bs)) + list(range(500, 500 + 4 * bs)),
            list(range(2 * bs)) + list(range(500, 500 + bs)) + list(range(900, 900 + 3 * bs))]


def block_key(prompts: list[list[int]], bs: int, p: int, b: int) -> tuple[int, int]:
    """Block ``b`` of prompt ``p`` as (the first prompt with that token prefix, b): prompts
    sharing a prefix share the block."""
    for q in range(p):
        if prompts[q][:(b + 1) * bs] == prompts[p][:(b + 1) * bs]:
            return (q, b)
    return (p, b)


def stamped(ts: float, *events: KVEvent) -> KVEventBatch:
    """A batch through the real codec, with the publisher's timestamp ``ts`` (what tells a live
    copy of a replayed batch from a restarted engine's batch of the same number)."""
    return decode_payload(encode_payload(KVEventBatch(ts, list(events))))
