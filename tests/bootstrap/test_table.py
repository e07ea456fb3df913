"""The pure rank table: validation, topology from the first registrant, 409, distinct readiness."""
from __future__ import annotations

import logging

import pytest
from bootstrap_helpers import rank_body

from bootstrap.table import DECODE_NULL_FIELDS, RankTable, RegistrationError, parse_registration

DOC_ORDER = ["attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
             "follow_bootstrap_room", "enable_dsa_cache_layer_split", "dsv41_spec_layout",
             "kv_layout", "decode_allocation_policy", "enable_kv_cache_sharding",
             "prefill_http_port", *DECODE_NULL_FIELDS]


def test_topology_document_key_order_and_nulls() -> None:
    table = RankTable()
    table.register(parse_registration(rank_body(tp_size=1)))
    doc = table.topology.document()  # type: ignore[union-attr]
    assert list(doc) == [k for k in DOC_ORDER if k not in ("dsv41_spec_layout", "kv_layout")]
    assert all(doc[k] is None for k in DECODE_NULL_FIELDS)

    with_layouts = RankTable()
    with_layouts.register(parse_registration(
        rank_body(kv_layout="NHD", dsv41_spec_layout={"split": 2})))
    doc = with_layouts.topology.document()  # type: ignore[union-attr]
    assert list(doc) == DOC_ORDER
    assert doc["kv_layout"] == "NHD" and doc["dsv41_spec_layout"] == {"split": 2}


def test_system_dp_picks_the_row_and_the_size() -> None:
    reg = parse_registration(rank_body(system_dp_size=4, system_dp_rank=3, dp_size=1, dp=0))
    assert reg.cell == (3, 0, 0, 0)
    assert reg.topology.dp_size == 4
    reg = parse_registration(rank_body(dp_size=2, dp=1))
    assert reg.cell == (1, 0, 0, 0) and reg.topology.dp_size == 2


def test_load_balance_method_sets_follow_bootstrap_room() -> None:
    assert parse_registration(rank_body()).topology.follow_bootstrap_room is True
    body = rank_body(load_balance_method="round_robin")
    assert parse_registration(body).topology.follow_bootstrap_room is False
    del body["load_balance_method"]
    assert parse_registration(body).topology.follow_bootstrap_room is True


def test_readiness_counts_distinct_cells_only() -> None:
    table = RankTable()
    for _ in range(5):  # SGLang would count these five PUTs and call a 4-rank instance ready
        assert table.register(parse_registration(rank_body(tp=0, tp_size=2, pp_size=2))) in (
            "new", "unchanged")
    assert table.registered == 1 and table.expected == 4 and not table.ready
    for tp, pp in [(1, 0), (0, 1)]:
        table.register(parse_registration(rank_body(tp=tp, pp=pp, tp_size=2, pp_size=2)))
        assert not table.ready
    assert table.register(parse_registration(rank_body(tp=1, pp=1, tp_size=2, pp_size=2))) == "new"
    assert table.ready and table.registered == 4


def test_replacement_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    table = RankTable()
    table.register(parse_registration(rank_body(port=5000)))
    with caplog.at_level(logging.WARNING, logger="bootstrap.table"):
        assert table.register(parse_registration(rank_body(port=5001, ip="10.0.0.9"))) == "replaced"
    assert "10.0.0.9:5001 replaces 10.0.0.1:5000" in caplog.text
    assert table.lookup((0, 0, 0, 0)).rank_port == 5001  # type: ignore[union-attr]
    assert table.registered == 1


@pytest.mark.parametrize("field,value", [
    ("attn_tp_size", 4), ("attn_cp_size", 2), ("attn_dp_size", 2), ("pp_size", 2),
    ("page_size", 32), ("kv_cache_dtype", "fp8_e5m2"), ("decode_allocation_policy", "late"),
    ("dsv41_spec_layout", "v2"), ("kv_layout", "HND"),
])
def test_contradicting_topology_is_409_naming_the_field(field: str, value: object) -> None:
    table = RankTable()
    table.register(parse_registration(rank_body(tp_size=2)))
    body = rank_body(tp=1, tp_size=2)
    body[field] = value
    with pytest.raises(RegistrationError) as err:
        table.register(parse_registration(body))
    expected_field = "dp_size" if field == "attn_dp_size" else field
    assert err.value.status == 409 and err.value.field == expected_field
    assert expected_field in str(err.value)
    assert table.registered == 1 and (0, 0, 1, 0) not in table.cells


def test_non_topology_scalars_keep_the_first_registrants_value() -> None:
    table = RankTable()
    table.register(parse_registration(rank_body(tp_size=2, prefill_http_port=30000)))
    assert table.register(parse_registration(
        rank_body(tp=1, tp_size=2, prefill_http_port=30001, enable_kv_cache_sharding=True))) == "new"
    assert table.topology.prefill_http_port == 30000  # type: ignore[union-attr]
    assert table.topology.enable_kv_cache_sharding is False  # type: ignore[union-attr]


@pytest.mark.parametrize("mutate,field", [
    (lambda b: b.pop("rank_ip"), "rank_ip"),
    (lambda b: b.pop("attn_tp_rank"), "attn_tp_rank"),
    (lambda b: b.pop("kv_cache_dtype"), "kv_cache_dtype"),
    (lambda b: b.update(attn_tp_size="2x"), "attn_tp_size"),
    (lambda b: b.update(attn_tp_rank=True), "attn_tp_rank"),
    (lambda b: b.update(pp_rank=0.0), "pp_rank"),
    (lambda b: b.update(attn_tp_rank=-1), "attn_tp_rank"),
    (lambda b: b.update(attn_tp_rank=1), "attn_tp_rank"),
    (lambda b: b.update(attn_tp_size=0), "attn_tp_size"),
    (lambda b: b.update(pp_size=-2), "pp_size"),
    (lambda b: b.update(system_dp_rank=1), "system_dp_rank"),
    (lambda b: b.update(rank_port=0), "rank_port"),
    (lambda b: b.update(rank_port=65536), "rank_port"),
    (lambda b: b.update(rank_port="http"), "rank_port"),
    (lambda b: b.update(rank_ip="300.1.2.3"), "rank_ip"),
    (lambda b: b.update(rank_ip="not a host"), "rank_ip"),
    (lambda b: b.update(rank_ip=""), "rank_ip"),
    (lambda b: b.update(rank_ip=17), "rank_ip"),
    (lambda b: b.update(page_size=0), "page_size"),
    (lambda b: b.update(kv_cache_dtype=3), "kv_cache_dtype"),
    (lambda b: b.update(prefill_http_port=70000), "prefill_http_port"),
    (lambda b: b.update(enable_kv_cache_sharding="yes"), "enable_kv_cache_sharding"),
])
def test_bad_registrations_are_400_naming_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    body = rank_body()
    mutate(body)
    with pytest.raises(RegistrationError) as err:
        parse_registration(body)
    assert err.value.status == 400 and err.value.field == field
    assert field in str(err.value)


def test_accepts_what_sglang_accepts() -> None:
    reg = parse_registration(rank_body(rank_port="5005", page_size="32", ip="fe80::1",
                                       unknown_future_field={"x": 1}))
    assert (reg.rank_ip, reg.rank_port, reg.topology.page_size) == ("fe80::1", 5005, 32)
    assert parse_registration(rank_body(ip="prefill-0.svc.cluster.local")).rank_ip == \
        "prefill-0.svc.cluster.local"
    with pytest.raises(RegistrationError):
        parse_registration(["not", "an", "object"])
