"""Shared helpers of the engine tests: prompt sets with shared prefixes and request builders."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import waiting

from engine.sampling import SamplingParams
from engine.scheduler import Request
from tokenization import ByteTokenizer

BOS_ID = ByteTokenizer().bos_id


def shared_prefix_prompts(n: int, seed: int, n_bases: int = 6, base_len: tuple[int, int] = (8, 70),
                          tail_len: tuple[int, int] = (1, 40)) -> list[list[int]]:
    """``n`` prompts; each is one of ``n_bases`` shared heads (BOS + random bytes) plus a random
    tail, so many prompts share full blocks and some share a head that is not block aligned."""
    rng = random.Random(seed)
    bases = [[BOS_ID] + [rng.randrange(256) for _ in range(rng.randint(*base_len))]
             for _ in range(n_bases)]
    return [rng.choice(bases) + [rng.randrange(256) for _ in range(rng.randint(*tail_len))]
            for _ in range(n)]


def greedy(max_new_tokens: int = 6) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def requests(prompts: list[list[int]], params: SamplingParams, tag: str = "r") -> list[Request]:
    return [Request(f"{tag}{i}", list(p), params) for i, p in enumerate(prompts)]


def assert_idle(sched: Any) -> None:
    """The pool at rest: no request queued, running or holding pages, and no page referenced
    (cached pages stay cached, but no reference is left on them)."""
    assert not sched.waiting and not sched.running and not sched.held, (
        len(sched.waiting), len(sched.running), list(sched.held))
    assert sched.cache.pages_in_use == 0, sched.cache.pages_in_use
    refs = {p: sched.pool.refcount(p) for p in range(sched.pool.num_pages)
            if sched.pool.refcount(p)}
    assert not refs, f"pages still referenced: {refs}"
    cached = len(sched.cache.blocks())
    assert sched.pool.num_free + cached == sched.pool.num_pages, (sched.pool.num_free, cached)


async def wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll ``cond`` (a state of the engine, read between its steps) until it holds: the shared
    ``waiting.wait_until``, polled often (the engine's steps are short)."""
    await waiting.wait_until(cond, what=what, timeout=timeout, interval=0.01)


async def wait_indexed(etcd: Any, layout: Any, instance: str, ids: list[int],
                       model: str = "tiny") -> set[int]:
    """Until the block index shows ``instance`` holding every full block of ``ids`` (the
    base namespace's hashes, 16-token blocks); the hashes waited for."""
    from index.hashing import BASE_SEED, block_hashes
    from index.segments import held_blocks

    want = set(block_hashes(ids, 16, BASE_SEED))
    assert len(want) >= 2, "a prompt of fewer than two full blocks proves little"

    async def indexed() -> bool:
        _, kvs = await etcd.get_prefix(layout.blocks_prefix(model, instance))
        return set(held_blocks(kv.value for kv in kvs)) >= want
    await waiting.wait_until(indexed, what=f"the prompt's blocks are indexed under {instance}",
                             timeout=20.0, interval=0.2)
    return want
