"""Shared helpers of the engine tests: prompt sets with shared prefixes and request builders."""
from __future__ import annotations

import random

from engine.sampling import SamplingParams
from engine.scheduler import Request
from engine.tokenizer import BOS_ID


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
