"""One contract for both block tables (pure Python and compiled core): unit cases, then a
state machine against a model (instance -> set of hashes) whose lookups are the longest-prefix
answer computed block by block."""
from __future__ import annotations

import os

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from table_backends import longest_prefixes, table_classes

import index.table
from index.table import CoreBlockTable, TableBase
from index.tiers import TierMatch

U64 = 2**64 - 1


def test_compiled_core_is_built_in_ci() -> None:
    # In CI the extension must build: a silent fallback would hide a broken build (and a
    # 5x slower router) behind green tests.
    if not os.environ.get("CI"):
        pytest.skip("only enforced in CI (CI is not set)")
    assert CoreBlockTable is not None, "index._table_core did not build"
    if os.environ.get("KVATLAS_PURE_TABLE") != "1":
        assert index.table.BACKEND == "compiled"


@table_classes
def test_add_lookup_remove(table_cls: type[TableBase]) -> None:
    t = table_cls()
    assert t.version == 0 and len(t) == 0 and t.lookup([1]) == {} and t.lookup([]) == {}
    t.apply_add("a", [0, 1, U64])  # the extremes of the hash range are ordinary keys
    t.apply_add("b", (0, 1))
    v = t.version
    assert v > 0
    assert t.lookup([0, 1, U64, 7]) == {"a": 3, "b": 2}
    assert t.lookup((1, U64)) == {"a": 2, "b": 1}
    assert t.lookup([U64, 0]) == {"a": 2}
    assert t.lookup([7, 0]) == {}
    assert len(t) == 3 and t.entries() == 5 and t.count("a") == 3 and t.count("zz") == 0
    assert t.holds("a", U64) and not t.holds("b", U64) and not t.holds("zz", 0)
    assert t.blocks("a") == {0, 1, U64} and t.blocks("zz") == set()
    t.apply_remove("a", [1, 99])  # 99 is not held: ignored
    assert t.version > v
    assert t.lookup([0, 1, U64]) == {"a": 1, "b": 2}
    assert t.count("a") == 2 and len(t) == 3
    t.apply_remove("b", [0, 1])
    assert t.instances() == {"a"} and len(t) == 2
    t.apply_remove("zz", [0])  # an unknown instance: nothing happens
    assert t.clear_instance("a") == 2 and t.clear_instance("a") == 0
    assert len(t) == 0 and t.instances() == set() and t.entries() == 0
    t.apply_add("c", iter([5, 6]))  # any iterable
    t.apply_add("c", [])
    assert t.lookup([5, 6]) == {"c": 2}
    t.clear()
    assert len(t) == 0 and t.lookup([5]) == {} and t.version > 0


@table_classes
def test_media(table_cls: type[TableBase]) -> None:
    t = table_cls()
    hs = [11, 12, 13, 14, 15]
    t.apply_add("a", hs[:2])
    t.apply_add("a", hs[2:4], "CPU")
    t.apply_add("b", hs, None)
    assert t.lookup_detailed(hs) == {"a": (4, 2), "b": (5, 5)}
    assert t.lookup_tiers(hs)["a"] == TierMatch(device=2, host=2)
    assert t.medium("a", 13) == "CPU" and t.medium("a", 11) == "GPU" and t.medium("a", 15) is None
    t.apply_add("a", [13])  # back on the GPU
    assert t.medium("a", 13) == "GPU" and t.lookup_detailed(hs)["a"] == (4, 3)
    t.apply_remove("a", [14])
    assert t.medium("a", 14) is None and t.lookup_detailed(hs)["a"] == (3, 3)
    t.replace_instance("b", {11: "GPU", 12: "DISK"})
    assert t.lookup_tiers(hs)["b"] == TierMatch(device=1, disk=1)
    t.clear_instance("b")
    assert t.medium("b", 12) is None and t.lookup_tiers(hs) == {"a": TierMatch(device=3)}
    assert t.lookup_tiers([99]) == {} and t.lookup_detailed([99]) == {}


@table_classes
def test_many_instances_widen_the_masks(table_cls: type[TableBase]) -> None:
    t = table_cls()
    # 300 instances: masks of 5 words; instance i holds the first i + 1 blocks.
    chain = list(range(1000, 1300))
    for i in range(300):
        t.apply_add(f"i{i}", chain[:i + 1])
    assert t.lookup(chain) == {f"i{i}": i + 1 for i in range(300)}
    assert t.lookup(chain[:70]) == {f"i{i}": min(i + 1, 70) for i in range(300)}
    assert len(t) == 300 and t.entries() == 300 * 301 // 2
    for i in range(0, 300, 2):
        t.clear_instance(f"i{i}")
    assert t.lookup(chain) == {f"i{i}": i + 1 for i in range(1, 300, 2)}
    # Freed slots are reused, lowest first.
    t.apply_add("new", chain[:1])
    assert t._slots["new"] == 0


@table_classes
def test_slots_released_and_reused(table_cls: type[TableBase]) -> None:
    t = table_cls()
    for round_ in range(50):
        t.apply_add(f"inst-{round_}", [1, 2, 3])
        t.apply_remove(f"inst-{round_}", [1, 2, 3])
    t.apply_add("last", [1, 2, 3])
    assert t._slots == {"last": 0} and t.lookup([1, 2, 3]) == {"last": 3}


@table_classes
def test_large_table_survives_growth_and_deletes(table_cls: type[TableBase]) -> None:
    t = table_cls()
    hs = [(i * 0x9E3779B97F4A7C15) & U64 for i in range(20_000)]
    t.apply_add("a", hs)
    t.apply_add("b", hs[::3])
    t.apply_remove("a", hs[::2])
    assert len(t) == len(set(hs[1::2]) | set(hs[::3]))
    assert t.blocks("a") == set(hs[1::2]) and t.blocks("b") == set(hs[::3])
    assert all(t.holds("a", h) == (i % 2 == 1) for i, h in enumerate(hs))
    assert t.clear_instance("a") == 10_000
    assert t.blocks("b") == set(hs[::3]) and len(t) == len(hs[::3])


@table_classes
def test_long_prompts(table_cls: type[TableBase]) -> None:
    # Longer than what the compiled core converts on its stack (512 blocks).
    t = table_cls()
    chain = [(i * 0x9E3779B97F4A7C15 + 1) & U64 for i in range(3000)]
    t.apply_add("a", chain)
    t.apply_add("b", tuple(chain[:1500]))
    t.apply_remove("a", chain[2000:2001])
    assert t.lookup(chain) == {"a": 2000, "b": 1500}
    assert t.lookup(chain[1:]) == {"a": 1999, "b": 1499}


def test_compiled_core_refuses_what_is_not_a_u64() -> None:
    if CoreBlockTable is None:
        pytest.skip("index._table_core is not built")
    t = CoreBlockTable()
    with pytest.raises(OverflowError, match="unsigned 64-bit"):
        t.apply_add("a", [1, -1])
    with pytest.raises(OverflowError):
        t.apply_add("a", [2**64])
    with pytest.raises(TypeError, match="must be an int"):
        t.apply_add("a", [1, "x"])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        t.lookup([1.5])  # type: ignore[list-item]
    # Nothing of a refused batch is stored, and no instance is left interned.
    assert len(t) == 0 and t.instances() == set()
    t.apply_add("a", [1])
    with pytest.raises(OverflowError):
        t.apply_remove("a", [-5])
    assert t.lookup([1]) == {"a": 1}


NAMES = st.sampled_from(["a", "b", "c", "d"])
# A small universe, so that overlaps, holes and shared blocks are frequent; the spread makes the
# compiled table's buckets collide and shift back on deletes.
HASHES = st.integers(0, 15).map(lambda i: (i * 0x9E3779B97F4A7C15) & U64 if i else 0)


class TableMachine(RuleBasedStateMachine):
    table_cls: type[TableBase]

    def __init__(self) -> None:
        super().__init__()
        self.t = self.table_cls()
        self.model: dict[str, set[int]] = {}

    @rule(name=NAMES, hashes=st.lists(HASHES, max_size=8))
    def add(self, name: str, hashes: list[int]) -> None:
        self.t.apply_add(name, hashes)
        if hashes:
            self.model.setdefault(name, set()).update(hashes)

    @rule(name=NAMES, hashes=st.lists(HASHES, max_size=8))
    def remove(self, name: str, hashes: list[int]) -> None:
        self.t.apply_remove(name, hashes)
        held = self.model.get(name)
        if held is not None:
            held.difference_update(hashes)
            if not held:
                del self.model[name]

    @rule(name=NAMES)
    def clear_instance(self, name: str) -> None:
        assert self.t.clear_instance(name) == len(self.model.pop(name, set()))

    @rule(name=NAMES, hashes=st.sets(HASHES, max_size=6))
    def replace(self, name: str, hashes: set[int]) -> None:
        self.t.replace_instance(name, dict.fromkeys(hashes, "GPU"))
        self.model.pop(name, None)
        if hashes:
            self.model[name] = set(hashes)

    @rule(prompt=st.lists(HASHES, max_size=12))
    def lookup(self, prompt: list[int]) -> None:
        assert self.t.lookup(prompt) == longest_prefixes(self.model, prompt)

    @invariant()
    def same_content(self) -> None:
        assert self.t.instances() == set(self.model)
        for name, held in self.model.items():
            assert self.t.blocks(name) == held and self.t.count(name) == len(held)
        assert len(self.t) == len(set().union(*self.model.values()))
        assert self.t.entries() == sum(len(h) for h in self.model.values())


@table_classes
def test_state_machine(table_cls: type[TableBase]) -> None:
    machine = type(f"TableMachine_{table_cls.__name__}", (TableMachine,), {"table_cls": table_cls})
    state = machine.TestCase  # type: ignore[attr-defined]
    state.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
    state().runTest()
