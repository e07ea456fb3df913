"""The BlockIndex contract against the memory backend, plus a hypothesis state machine checking
``BlockTable``/``MemoryBlockIndex`` against a plain dict-of-sets model."""
from __future__ import annotations

import asyncio

import pytest
from block_index_contract import BlockIndexContract
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from memory_index import MemoryBlockIndex
from table_backends import longest_prefixes


class TestMemoryBlockIndex(BlockIndexContract):
    @pytest.fixture
    def make_index(self):
        async def make() -> MemoryBlockIndex:
            return MemoryBlockIndex()
        return make


def test_lookup_detailed_reports_gpu_prefix() -> None:
    idx = MemoryBlockIndex()
    hs = [11, 12, 13, 14, 15]
    asyncio.run(idx.add("a", None, hs[:2]))
    asyncio.run(idx.add("a", hs[1], hs[2:4], medium="CPU"))
    asyncio.run(idx.add("b", None, hs))
    assert idx.lookup_detailed(hs) == {"a": (4, 2), "b": (5, 5)}
    assert idx.lookup_detailed([99]) == {}


def test_slots_are_reused_and_masks_stay_narrow() -> None:
    idx = MemoryBlockIndex()
    for round_ in range(50):
        name = f"inst-{round_}"
        asyncio.run(idx.add(name, None, [1, 2, 3]))
        asyncio.run(idx.clear(name))
    asyncio.run(idx.add("last", None, [1, 2, 3]))
    # The only live instance got the lowest slot back, so masks are one bit wide.
    assert idx.table._slots == {"last": 0}
    assert idx.lookup([1, 2, 3]) == {"last": 3}


# A small hash universe (prompts are sequences drawn from it) makes overlaps, gaps and shared
# blocks between instances frequent.
HASHES = st.integers(min_value=0, max_value=11).map(lambda i: (i * 0x9E3779B97F4A7C15) % 2**64)
INSTANCES = st.sampled_from(["a", "b", "c", "d"])
MEDIA = st.sampled_from(["GPU", "GPU", "CPU", "CPU_PINNED"])


class MemoryIndexMachine(RuleBasedStateMachine):
    """Random add/remove/clear sequences; after each step the index equals the model."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.index = MemoryBlockIndex()
        self.model: dict[str, dict[int, str]] = {}

    def teardown(self) -> None:
        self.loop.close()

    def run(self, coro) -> None:
        self.loop.run_until_complete(coro)

    @rule(inst=INSTANCES, hashes=st.lists(HASHES, max_size=6), medium=MEDIA)
    def add(self, inst: str, hashes: list[int], medium: str) -> None:
        self.run(self.index.add(inst, None, hashes, medium))
        for h in hashes:
            self.model.setdefault(inst, {})[h] = medium

    @rule(inst=INSTANCES, hashes=st.lists(HASHES, max_size=6))
    def remove(self, inst: str, hashes: list[int]) -> None:
        self.run(self.index.remove(inst, hashes))
        held = self.model.get(inst, {})
        for h in hashes:
            held.pop(h, None)

    @precondition(lambda self: bool(self.model))
    @rule(inst=INSTANCES)
    def clear(self, inst: str) -> None:
        self.run(self.index.clear(inst))
        self.model.pop(inst, None)

    @rule(prompt=st.lists(HASHES, max_size=10))
    def lookup(self, prompt: list[int]) -> None:
        expected = longest_prefixes(self.model, prompt)
        assert self.index.lookup(prompt) == expected
        detailed = self.index.lookup_detailed(prompt)
        assert {k: v[0] for k, v in detailed.items()} == expected
        for inst, (n, gpu) in detailed.items():
            on_gpu = 0
            while on_gpu < n and self.model[inst][prompt[on_gpu]] == "GPU":
                on_gpu += 1
            assert gpu == on_gpu

    @invariant()
    def same_blocks(self) -> None:
        live = {inst for inst, held in self.model.items() if held}
        assert self.index.instances() == live
        for inst in ("a", "b", "c", "d"):
            held = self.model.get(inst, {})
            assert self.index.blocks(inst) == set(held)
            for h, medium in held.items():
                assert self.index.medium(inst, h) == medium
        distinct = set().union(*[set(h) for h in self.model.values()]) if self.model else set()
        assert len(self.index.table) == len(distinct)


TestMemoryIndexMachine = MemoryIndexMachine.TestCase
TestMemoryIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
