"""A rank key's value decodes strictly (``bootstrap.mirror.parse_rank_value``): what
``rank_value`` writes reads back, and any other bytes raise ``MalformedRank`` and nothing else."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.mirror import MalformedRank, parse_rank_value, rank_value
from bootstrap.table import RankEntry
from index.errors import MalformedValue
from index.keys import dumps

CELL = (0, 0, 1, 0)
GOOD = {"rank_ip": "10.0.0.1", "rank_port": 7000, "registered_at": 1.5, "attn_dp_rank": 0,
        "system_dp_rank": None, "dp": 0, "cp": 0, "tp": 1, "pp": 0}


def test_what_the_mirror_writes_reads_back() -> None:
    entry = RankEntry("10.0.0.1", 7000, 1.5, 0, None)
    assert parse_rank_value(dumps(rank_value(CELL, entry)), CELL) == entry


@pytest.mark.parametrize("change", [
    {"rank_port": True}, {"rank_port": 0}, {"rank_port": "7000"}, {"rank_ip": ""},
    {"registered_at": float("nan")}, {"registered_at": False}, {"attn_dp_rank": True},
    {"attn_dp_rank": -1}, {"tp": 2},  # a cell that disagrees with its key
])
def test_an_ill_typed_field_is_refused(change: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(MalformedRank) as err:
        parse_rank_value(json.dumps({**GOOD, **change}).encode(), CELL, b"/k")
    assert err.value.reason == "bad_rank" and isinstance(err.value, MalformedValue)


values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=120),
                 st.dictionaries(st.sampled_from([*GOOD, "x"]), values, max_size=9).map(
                     lambda d: json.dumps(d).encode())))
def test_any_bytes_decode_or_raise_malformed_rank(raw: bytes) -> None:
    try:
        parse_rank_value(raw, CELL)
    except MalformedRank:
        pass
