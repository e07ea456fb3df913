"""BlockTable.lookup of both backends against a block-by-block reference walk."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from table_backends import longest_prefixes, table_classes

from index.table import TableBase


@table_classes
@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 140), instances=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_lookup_matches_reference(table_cls: type[TableBase], n: int, instances: int,
                                  seed: int) -> None:
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(n)]
    table, held = table_cls(), {}
    for i in range(instances):
        name = f"i{i}"
        # A prefix of random length, sometimes with holes, plus unrelated blocks.
        upto = rng.randint(0, n)
        blocks = {h for k, h in enumerate(hashes[:upto]) if rng.random() > 0.03}
        blocks |= {rng.getrandbits(64) for _ in range(3)}
        table.apply_add(name, blocks)
        held[name] = blocks
    assert table.lookup(hashes) == longest_prefixes(held, hashes)
    assert table.lookup(tuple(hashes)) == longest_prefixes(held, hashes)


@table_classes
def test_version_changes_on_every_write_and_is_unique(table_cls: type[TableBase]) -> None:
    a, b = table_cls(), table_cls()
    assert a.version == b.version == 0
    b.apply_add("x", [1, 2])
    versions = [a.version]
    for op in (lambda: a.apply_add("x", [1, 2]), lambda: a.apply_remove("x", [1]),
               lambda: a.clear_instance("x"), a.clear):
        op()
        versions.append(a.version)
    assert versions == sorted(set(versions)) and b.version not in versions
    before = a.version
    assert a.lookup([1]) == {} and a.version == before  # reads leave it alone
