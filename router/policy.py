"""Selection policies: the small ABC and the load-only ones (round robin, random, power of two).

A policy picks one worker among the *available* ones of a pool; the caller has already filtered
out unready, unhealthy and open-circuit workers, so an empty list never reaches ``select``.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from index.hashing import block_hashes
from router.workers import Worker


@dataclass
class RouteContext:
    """What a policy may look at besides the workers."""

    tokens: Any = field(default_factory=list)
    """Prompt token ids of the (first) prompt (a list or a uint32 array)."""
    model: str | None = None
    """Model whose hash namespace/index applies."""
    _hashes: list[int] | None = None

    def hashes(self, block_size: int, seed: int) -> list[int]:
        if self._hashes is None:
            self._hashes = block_hashes(self.tokens, block_size, seed)
        return self._hashes


@dataclass
class Choice:
    worker: Worker
    candidates: list[dict[str, Any]] = field(default_factory=list)
    """Per-candidate detail for /debug/route (kv_aware fills matched blocks and cost)."""
    matched_blocks: int = 0
    prompt_blocks: int = 0
    hashes: list[int] = field(default_factory=list)
    indexed_blocks: int = 0
    """Of ``matched_blocks``, those the block index shows (the rest are router predictions)."""
    model: str | None = None
    """The request's model (its index namespace)."""


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


def _plain(workers: list[Worker]) -> list[dict[str, Any]]:
    return [{"instance_id": w.instance_id, "matched_blocks": 0, "load": w.load, "cost": w.load}
            for w in workers]


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._next = 0

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        ordered = sorted(workers, key=lambda w: w.instance_id)
        worker = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(worker, _plain(workers))


class RandomPolicy(Policy):
    name = "random"

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        return Choice(self.rng.choice(workers), _plain(workers))


class PowerOfTwo(Policy):
    """Two random workers, the less loaded of them wins."""

    name = "power_of_two"

    def select(self, workers: list[Worker], ctx: RouteContext) -> Choice:
        if len(workers) == 1:
            return Choice(workers[0], _plain(workers))
        a, b = self.rng.sample(workers, 2)
        return Choice(a if a.load <= b.load else b, _plain(workers))


def make_policy(name: str, **kv_args: Any) -> Policy:
    """The policy called ``name``; kv_aware needs ``mirror``/``config`` keyword arguments."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomPolicy()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "kv_aware":
        from router.kv_aware import KvAware
        return KvAware(**kv_args)
    raise ValueError(f"unknown policy {name!r}")
