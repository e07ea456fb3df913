"""The decode -> prefill rank mapping: the reference doc's cases as a table, then properties that
must hold for every size pair (each prefill rank is read by exactly the decode ranks that map to
it), plus the topology document parser and the page_size / kv_cache_dtype check."""
from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.errors import TopologyMismatch
from bootstrap.mapping import (
    DecodeParallel,
    PrefillServerInfo,
    RankAddress,
    check_kv_compat,
    cp_targets,
    map_decode_rank,
    pp_readers,
    pp_targets,
    prefill_dp_for_room,
    tp_readers,
    tp_targets,
)


def prefill(tp: int = 1, pp: int = 1, cp: int = 1, dp: int = 1, **kw: Any) -> PrefillServerInfo:
    fields: dict[str, Any] = dict(attn_tp_size=tp, attn_cp_size=cp, dp_size=dp, pp_size=pp,
                                  page_size=16, kv_cache_dtype="auto", follow_bootstrap_room=True)
    fields.update(kw)
    return PrefillServerInfo(**fields)


# (decode tp, decode tp rank, prefill tp, decode pp, decode pp rank, prefill pp, mla)
#   -> (target tp ranks, target pp ranks, required_dst_info_num, required_prefill_response_num)
CASES = [
    # D == P: own rank, one response
    ((4, 0, 4, 1, 0, 1, False), ((0,), (0,), 1, 1)),
    ((4, 3, 4, 1, 0, 1, False), ((3,), (0,), 1, 1)),
    # D > P: D/P decode ranks share a prefill rank, which sends to D/P destinations
    ((4, 0, 2, 1, 0, 1, False), ((0,), (0,), 2, 1)),
    ((4, 1, 2, 1, 0, 1, False), ((0,), (0,), 2, 1)),
    ((4, 2, 2, 1, 0, 1, False), ((1,), (0,), 2, 1)),
    ((8, 7, 1, 1, 0, 1, False), ((0,), (0,), 8, 1)),
    # D < P: P/D consecutive prefill ranks, P/D responses (one for MLA)
    ((2, 0, 8, 1, 0, 1, False), ((0, 1, 2, 3), (0,), 1, 4)),
    ((2, 1, 8, 1, 0, 1, False), ((4, 5, 6, 7), (0,), 1, 4)),
    ((2, 1, 8, 1, 0, 1, True), ((4, 5, 6, 7), (0,), 1, 1)),
    ((1, 0, 4, 1, 0, 1, False), ((0, 1, 2, 3), (0,), 1, 4)),
    # PP equal: own pp rank
    ((2, 1, 2, 4, 3, 4, False), ((1,), (3,), 1, 1)),
    # decode pp 1: every prefill pp rank, one response each
    ((2, 1, 2, 1, 0, 4, False), ((1,), (0, 1, 2, 3), 1, 4)),
    ((2, 1, 4, 1, 0, 2, False), ((2, 3), (0, 1), 1, 4)),
    ((4, 3, 2, 1, 0, 3, False), ((1,), (0, 1, 2), 2, 3)),
]


@pytest.mark.parametrize(("given_", "expected"), CASES)
def test_reference_cases(given_: tuple[int, ...], expected: tuple[Any, ...]) -> None:
    d_tp, d_rank, p_tp, d_pp, d_pp_rank, p_pp, mla = given_
    mapping = map_decode_rank(
        DecodeParallel(attn_tp_size=d_tp, attn_tp_rank=d_rank, pp_size=d_pp, pp_rank=d_pp_rank),
        prefill(tp=p_tp, pp=p_pp), mla=bool(mla),
    )
    got = (mapping.target_tp_ranks, mapping.target_pp_ranks, mapping.required_dst_info_num,
           mapping.required_prefill_response_num)
    assert got == expected
    assert mapping.target_cp_ranks == (0,)
    assert mapping.target_tp_rank == expected[0][0]


def test_d_greater_than_p_sharing() -> None:
    """With D=8, P=2 the decode ranks sharing each prefill rank are the two halves."""
    assert tp_readers(0, 2, 8) == (0, 1, 2, 3)
    assert tp_readers(1, 2, 8) == (4, 5, 6, 7)
    assert tp_readers(5, 8, 2) == (1,)
    assert tp_readers(3, 4, 4) == (3,)


def test_cells_for_a_request() -> None:
    mapping = map_decode_rank(DecodeParallel(attn_tp_size=1, attn_tp_rank=0),
                              prefill(tp=2, pp=2, dp=4))
    assert mapping.cells(3) == [(3, 0, 0, 0), (3, 0, 0, 1), (3, 0, 1, 0), (3, 0, 1, 1)]
    assert mapping.required_prefill_response_num == len(mapping.cells(3))
    with pytest.raises(ValueError, match="dp rank"):
        mapping.cells(-1)


@pytest.mark.parametrize(("d_cp", "p_cp"), [(2, 1), (1, 2), (2, 2), (4, 4)])
def test_cp_other_than_one_is_refused(d_cp: int, p_cp: int) -> None:
    with pytest.raises(ValueError) as info:
        cp_targets(d_cp, p_cp)
    assert f"decode attn_cp_size {d_cp}" in str(info.value)
    assert f"prefill attn_cp_size {p_cp}" in str(info.value)
    with pytest.raises(ValueError, match="attn_cp_size"):
        map_decode_rank(DecodeParallel(attn_tp_size=1, attn_tp_rank=0, attn_cp_size=d_cp),
                        prefill(cp=p_cp))


@pytest.mark.parametrize(("d_pp", "p_pp"), [(2, 4), (4, 2), (3, 1), (2, 3)])
def test_pp_other_than_equal_or_one_is_refused(d_pp: int, p_pp: int) -> None:
    with pytest.raises(ValueError) as info:
        pp_targets(d_pp, 0, p_pp)
    assert f"decode pp_size {d_pp}" in str(info.value) and f"prefill pp_size {p_pp}" in str(info.value)


@pytest.mark.parametrize(("d_tp", "p_tp"), [(3, 2), (2, 3), (6, 4), (4, 6)])
def test_tp_sizes_that_do_not_divide_are_refused(d_tp: int, p_tp: int) -> None:
    with pytest.raises(ValueError) as info:
        tp_targets(d_tp, 0, p_tp)
    assert f"decode attn_tp_size {d_tp}" in str(info.value)
    assert f"prefill attn_tp_size {p_tp}" in str(info.value)


@pytest.mark.parametrize("bad", [
    dict(attn_tp_size=0, attn_tp_rank=0), dict(attn_tp_size=2, attn_tp_rank=2),
    dict(attn_tp_size=2, attn_tp_rank=-1), dict(attn_tp_size=True, attn_tp_rank=0),
    dict(attn_tp_size=2, attn_tp_rank=0, pp_size=2, pp_rank=2),
])
def test_decode_position_is_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="decode"):
        DecodeParallel(**bad)


def test_kv_compat_names_both_values() -> None:
    info = prefill(page_size=32, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(TopologyMismatch) as err:
        check_kv_compat(info, page_size=16, kv_cache_dtype="fp8_e4m3", addr="10.0.0.1:8998")
    assert "decode page_size 16 != prefill page_size 32" in str(err.value)
    assert "10.0.0.1:8998" in str(err.value) and "--page-size" in str(err.value)
    assert (err.value.field, err.value.decode_value, err.value.prefill_value) == ("page_size", 16, 32)
    with pytest.raises(TopologyMismatch) as err:
        check_kv_compat(info, page_size=32, kv_cache_dtype="bfloat16")
    assert "decode kv_cache_dtype 'bfloat16' != prefill kv_cache_dtype 'fp8_e4m3'" in str(err.value)
    assert isinstance(err.value, ValueError)
    check_kv_compat(info, page_size=32, kv_cache_dtype="fp8_e4m3")
    # A prefill that does not report a value is not checked on it (SGLang's decode does the same).
    check_kv_compat(prefill(page_size=None, kv_cache_dtype=None), page_size=64, kv_cache_dtype="x")


def test_prefill_dp_for_room() -> None:
    assert prefill_dp_for_room(10, prefill(dp=4)) == 2
    assert prefill_dp_for_room(2**63 - 1, prefill(dp=3)) == (2**63 - 1) % 3
    assert prefill_dp_for_room(10, prefill(dp=4, follow_bootstrap_room=False)) is None
    assert prefill_dp_for_room(10, prefill(dp=1, follow_bootstrap_room=False)) == 0
    with pytest.raises(ValueError, match="bootstrap_room"):
        prefill_dp_for_room(-1, prefill(dp=4))


# The document SGLang 0.5.23's server sends, in its key order.
SGLANG_DOC = {
    "attn_tp_size": 2, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1, "page_size": 64,
    "kv_cache_dtype": "auto", "follow_bootstrap_room": True, "enable_dsa_cache_layer_split": False,
    "decode_allocation_policy": "early", "enable_kv_cache_sharding": False,
    "prefill_http_port": 30000, "target_tp_rank": None, "target_tp_ranks": None,
    "target_cp_ranks": None, "target_pp_ranks": None, "required_dst_info_num": None,
    "required_prefill_response_num": None,
}


def test_topology_document_round_trip() -> None:
    info = PrefillServerInfo.from_json(SGLANG_DOC)
    assert (info.attn_tp_size, info.dp_size, info.page_size, info.prefill_http_port) == (2, 2, 64, 30000)
    assert info.num_ranks == 4 and info.extra == {}
    assert info.to_json() == SGLANG_DOC
    assert list(info.to_json()) == list(SGLANG_DOC)
    with_layouts = dict(SGLANG_DOC, kv_layout="NHD", dsv41_spec_layout={"block_size": 128},
                        future_field=[1])
    parsed = PrefillServerInfo.from_json(with_layouts)
    assert parsed.kv_layout == "NHD" and parsed.dsv41_spec_layout == {"block_size": 128}
    assert parsed.extra == {"future_field": [1]}


def test_topology_document_from_older_server() -> None:
    """SGLang before 0.5.23 sends neither the allocation policy nor the sharding flag."""
    old = {k: SGLANG_DOC[k] for k in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size",
                                      "page_size", "kv_cache_dtype", "follow_bootstrap_room")}
    info = PrefillServerInfo.from_json(old)
    assert info.decode_allocation_policy == "early" and info.enable_kv_cache_sharding is False


@pytest.mark.parametrize(("change", "named"), [
    ({"attn_tp_size": 0}, "attn_tp_size"), ({"dp_size": "2"}, "dp_size"),
    ({"pp_size": True}, "pp_size"), ({"page_size": -4}, "page_size"),
    ({"kv_cache_dtype": 5}, "kv_cache_dtype"), ({"follow_bootstrap_room": 1}, "follow_bootstrap_room"),
    ({"prefill_http_port": 70000}, "prefill_http_port"), ({"attn_cp_size": None}, "attn_cp_size"),
])
def test_bad_topology_document_names_the_field(change: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PrefillServerInfo.from_json(dict(SGLANG_DOC, **change))


def test_topology_document_missing_fields_and_wrong_shape() -> None:
    doc = dict(SGLANG_DOC)
    del doc["page_size"], doc["pp_size"]
    with pytest.raises(ValueError, match="lacks pp_size, page_size"):
        PrefillServerInfo.from_json(doc)
    with pytest.raises(ValueError, match="JSON object"):
        PrefillServerInfo.from_json([SGLANG_DOC])


def test_rank_address() -> None:
    assert RankAddress.from_json({"rank_ip": "10.1.2.3", "rank_port": 5757}).tcp_endpoint == "tcp://10.1.2.3:5757"
    assert RankAddress("fe80::1", 7000).tcp_endpoint == "tcp://[fe80::1]:7000"
    assert RankAddress("node-3.cluster.local", 7000).rank_ip == "node-3.cluster.local"
    for bad in ({"rank_ip": "10.1.2.3", "rank_port": 0}, {"rank_ip": "", "rank_port": 1},
                {"rank_ip": "a b", "rank_port": 1}, {"rank_ip": "10.1.2.3", "rank_port": "80"},
                {"rank_ip": "10.1.2.3"}):
        with pytest.raises(ValueError):
            RankAddress.from_json(bad)


# ---- properties -----------------------------------------------------------------------------

sizes = st.integers(min_value=1, max_value=8)


@st.composite
def tp_pairs(draw: st.DrawFn) -> tuple[int, int]:
    """(decode tp, prefill tp) where one divides the other, as the mapping requires."""
    small, ratio = draw(sizes), draw(st.integers(min_value=1, max_value=8))
    return (small, small * ratio) if draw(st.booleans()) else (small * ratio, small)


@settings(max_examples=200, deadline=None)
@given(tp_pairs())
def test_every_prefill_rank_is_read_by_exactly_its_readers(pair: tuple[int, int]) -> None:
    d, p = pair
    targets = {e: tp_targets(d, e, p) for e in range(d)}
    for q in range(p):
        readers = {e for e in range(d) if q in targets[e]}
        assert readers == set(tp_readers(q, p, d))
        assert readers, f"prefill tp rank {q} of {p} is read by no decode rank of {d}"
    # Each decode rank reads a disjoint, contiguous block when D < P, so no KV head is pulled twice.
    all_targets = [q for e in range(d) for q in targets[e]]
    if d <= p:
        assert sorted(all_targets) == list(range(p))
    for e in range(d):
        block = targets[e]
        assert list(block) == list(range(block[0], block[0] + len(block)))


@settings(max_examples=200, deadline=None)
@given(tp_pairs(), st.sampled_from([(1, 1), (2, 2), (4, 4), (1, 2), (1, 4), (1, 3)]),
       st.booleans(), st.data())
def test_mapping_counts_match_cells(pair: tuple[int, int], pps: tuple[int, int], mla: bool,
                                    data: st.DataObject) -> None:
    d, p = pair
    d_pp, p_pp = pps
    e = data.draw(st.integers(min_value=0, max_value=d - 1))
    e_pp = data.draw(st.integers(min_value=0, max_value=d_pp - 1))
    mapping = map_decode_rank(DecodeParallel(attn_tp_size=d, attn_tp_rank=e, pp_size=d_pp,
                                             pp_rank=e_pp), prefill(tp=p, pp=p_pp), mla=mla)
    cells = mapping.cells(0)
    assert len(set(cells)) == len(cells)
    if not mla or d >= p:
        # the decode waits for exactly one answer per prefill rank it reads
        assert mapping.required_prefill_response_num == len(cells)
    else:
        assert mapping.required_prefill_response_num == len(mapping.target_pp_ranks)
    # a prefill rank sends to as many decode tp ranks as read it
    assert mapping.required_dst_info_num == len(tp_readers(mapping.target_tp_rank, p, d))
    # pp: the union over the decode's pp ranks covers every prefill stage exactly once per reader
    covered = [q for r in range(d_pp) for q in pp_targets(d_pp, r, p_pp)]
    assert sorted(covered) == list(range(p_pp))
    for q in range(p_pp):
        assert set(pp_readers(q, p_pp, d_pp)) == {r for r in range(d_pp) if q in pp_targets(d_pp, r, p_pp)}


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=64))
def test_sizes_that_do_not_divide_always_raise(d: int, p: int) -> None:
    if max(d, p) % min(d, p) == 0:
        assert len(tp_targets(d, d - 1, p)) == max(1, p // d)
    else:
        with pytest.raises(ValueError, match=f"decode attn_tp_size {d} and prefill attn_tp_size {p}"):
            tp_targets(d, 0, p)


topologies = st.builds(
    PrefillServerInfo, attn_tp_size=sizes, attn_cp_size=sizes, dp_size=sizes, pp_size=sizes,
    page_size=st.one_of(st.none(), st.integers(min_value=1, max_value=4096)),
    kv_cache_dtype=st.one_of(st.none(), st.sampled_from(["auto", "fp8_e4m3", "bfloat16"])),
    follow_bootstrap_room=st.booleans(), enable_dsa_cache_layer_split=st.booleans(),
    kv_layout=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    decode_allocation_policy=st.sampled_from(["early", "late"]),
    enable_kv_cache_sharding=st.booleans(),
    prefill_http_port=st.one_of(st.none(), st.integers(min_value=1, max_value=65535)),
)


@settings(max_examples=100, deadline=None)
@given(topologies)
def test_topology_document_round_trips(info: PrefillServerInfo) -> None:
    assert PrefillServerInfo.from_json(info.to_json()) == info


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=2**64 - 1), sizes)
def test_room_dp_is_in_range_and_stable(room: int, dp: int) -> None:
    got = prefill_dp_for_room(room, prefill(dp=dp))
    assert got is not None and 0 <= got < dp
    assert got == prefill_dp_for_room(room + dp, prefill(dp=dp))


def test_whole_instance_coverage_table() -> None:
    """Across every decode rank of a D<P and a D>P pair, each prefill cell gets the
    expected number of readers (1 for D<P, D/P for D>P) for a 2-stage pp instance read by pp 1."""
    for d, p in ((2, 8), (8, 2), (4, 4)):
        seen: dict[tuple[int, int, int, int], int] = {}
        for e in range(d):
            mapping = map_decode_rank(DecodeParallel(attn_tp_size=d, attn_tp_rank=e), prefill(tp=p, pp=2))
            for cell in mapping.cells(0):
                seen[cell] = seen.get(cell, 0) + 1
        expected = {(0, 0, q, s): max(1, d // p) for q, s in itertools.product(range(p), range(2))}
        assert seen == expected
