"""Selection policies: the small ABC and the load-only ones (round robin, random, power of two).

A policy picks one worker among the *available* ones of a pool; the caller has already filtered
out unready, unhealthy and open-circuit workers, so an empty list never reaches ``select``.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.prompt_hashes import MAX_ROUTED_BLOCKS, PromptHasher, prompt_hashes, routed_tokens
from router.workers import Worker

__all__ = ["MAX_ROUTED_BLOCKS", "prompt_hashes", "routed_tokens"]  # re-exported: their home is
# router.prompt_hashes, which request parsing imports without the policies

@dataclass
class RouteContext:
    """What a policy may look at besides the workers."""

    tokens: Any = field(default_factory=list)
    """Prompt token ids of the (first) prompt (a list or a uint32 array)."""
    model: str | None = None
    """Model whose hash namespace/index applies."""
    pre_hashed: tuple[int, list[int]] | None = None
    """(seed, hashes) computed before, off the event loop (``prompt_hashes``, by the same
    memoized hasher)."""
    samples: tuple[str, int] | None = None
    """(field, n) of a request asking for n > 1 samples: only a worker that serves it whole
    may take it (``Parsed.samples``)."""
    vllm_pd: bool = False
    """vLLM's PD protocol can carry it: an OpenAI completion or chat with one prompt (vLLM has
    no ``/generate``, and its ``kv_transfer_params`` name one request's blocks)."""
    _hashes: list[int] | None = None

    def hashes(self, hasher: PromptHasher, seed: int) -> list[int]:
        """The prompt's block hashes in namespace ``seed`` (computed once per request)."""
        if self._hashes is None:
            pre = self.pre_hashed
            if pre is not None and pre[0] == seed:
                self._hashes = pre[1]
            else:
                self._hashes = hasher.hashes(routed_tokens(self.tokens, hasher.block_size),
                                             seed)
        return self._hashes


class Choice:
    """A policy's pick and what /debug/route and ``on_routed`` need to know about it."""

    __slots__ = ("worker", "_candidates", "_build", "matched_blocks", "prompt_blocks", "hashes",
                 "indexed_blocks", "model", "best_matched")

    def __init__(self, worker: Worker,
                 candidates: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]] | None
                 = None, matched_blocks: int = 0, prompt_blocks: int = 0,
                 hashes: list[int] | None = None, indexed_blocks: int = 0,
                 model: str | None = None, best_matched: int | None = None) -> None:
        self.worker = worker
        # Built only when read (/debug/route): routing a request never needs them.
        self._candidates = None if callable(candidates) else (candidates or [])
        self._build = candidates if callable(candidates) else None
        self.matched_blocks = matched_blocks
        self.prompt_blocks = prompt_blocks
        self.hashes = hashes if hashes is not None else []
        self.indexed_blocks = indexed_blocks
        """Of ``matched_blocks``, those the block index shows (the rest are router predictions)."""
        self.model = model
        """The request's model (its index namespace)."""
        self.best_matched = matched_blocks if best_matched is None else best_matched
        """The longest overlap any candidate had: above ``matched_blocks`` when load won."""

    @property
    def candidates(self) -> list[dict[str, Any]]:
        """Per-candidate detail for /debug/route (kv_aware fills matched blocks and cost)."""
        if self._candidates is None:
            build, self._build = self._build, None
            self._candidates = build() if build is not None else []
        return self._candidates

    @candidates.setter
    def candidates(self, value: list[dict[str, Any]]) -> None:
        self._candidates, self._build = value, None

    def __repr__(self) -> str:
        return (f"Choice(worker={self.worker.instance_id!r}, matched_blocks={self.matched_blocks}, "
                f"prompt_blocks={self.prompt_blocks}, indexed_blocks={self.indexed_blocks}, "
                f"model={self.model!r})")


class Policy(ABC):
    name: str = ""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @abstractmethod
    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        """Pick one of ``workers`` (never empty)."""

    def on_routed(self, choice: Choice) -> None:
        """Told after a request was dispatched to ``choice`` (kv_aware records its prediction)."""

    def forget(self, instance_id: str) -> None:
        """Told when an instance leaves the pool."""

    def predicted_blocks(self) -> int | None:
        """Blocks the policy currently counts as cached by its own prediction (for the
        metrics); None for a policy that predicts nothing."""
        return None


def _plain(workers: list[Worker]) -> list[dict[str, Any]]:
    return [{"instance_id": w.instance_id, "matched_blocks": 0, "index_blocks": 0,
             "predicted_blocks": 0, "load": w.load, "cost": w.load} for w in workers]


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._next = 0

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        ordered = sorted(workers, key=lambda w: w.instance_id)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(worker, lambda: _plain(workers))


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        return Choice(self.rng.choice(workers), lambda: _plain(workers))


class PowerOfTwo(Policy):
    """Two random workers, the less loaded of them wins."""

    name = "power_of_two"

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0], lambda: _plain(workers))
        a, b = _sample_two(self.rng, workers)
        return Choice(a if a.load <= b.load else b, lambda: _plain(workers))


def _sample_two(rng: random.Random, workers: list[Worker]) -> tuple[Worker, Worker]:
    """``rng.sample(workers, 2)``: the same draws and the same result, without its generality
    (a few microseconds per request)."""
    n = len(workers)
    below = rng._randbelow  # what sample() itself draws with
    if n <= 21:  # sample()'s pool method (its set size for k=2)
        i = below(n)
        j = below(n - 1)
        return workers[i], workers[n - 1] if j == i else workers[j]
    i = below(n)
    j = below(n)
    while j == i:
        j = below(n)
    return workers[i], workers[j]

