"""The aggregated and mixed-fleet modes of the routing benches (bench/_routing_cluster.py,
bench/mixed_fleet.py): the mixed trace, and a real aggregated cluster replaying through kv_aware.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.bench.bench_modules import load as _load

rt = _load("_routing_trace")
_load("_results")
rc = _load("_routing_cluster")
mf = _load("mixed_fleet")
mp = _load("_mixed_probe")


def test_mixed_trace_has_every_kind_and_conversations_grow() -> None:
    reqs, kinds = mf.mixed_trace(seed=1, short=6, long=3, conversations=2, turns=3)
    assert (reqs, kinds) == mf.mixed_trace(seed=1, short=6, long=3, conversations=2, turns=3)
    counts = {k: sum(1 for v in kinds.values() if v == k) for k in mf.KINDS}
    assert counts == {"short": 6, "long": 3, "opener": 2, "followup": 4}
    sizes = {k: [len(rt.prompt_tokens(r.text)) for r in reqs if kinds[r.rid] == k]
             for k in mf.KINDS}
    # short prompts stay under the default disagg threshold, long ones far above it
    assert max(sizes["short"]) < 128 and min(sizes["long"]) > 1024
    last: dict[str, str] = {}
    for r in reqs:
        assert len(rt.prompt_tokens(r.text)) + r.max_new_tokens <= rt.MAX_POSITIONS
        if kinds[r.rid] == "followup":
            # each follow-up extends its conversation's previous turn (a cacheable prefix)
            assert r.text.startswith(last[r.session])
        if r.session:
            last[r.session] = r.text


def test_summarize_splits_ttft_by_kind_and_reads_decisions() -> None:
    kinds = {0: "short", 1: "short", 2: "long", 3: "opener"}
    res = {"ok": 4, "wall_s": 2.0, "ttft_ms_by_rid": {0: 10.0, 1: 30.0, 2: 100.0, 3: 90.0},
           "router_view": {"disagg:pd:long_uncached": 2.0, "disagg:aggregated:short_uncached": 2.0,
                           "index_blocks": 7.0}}
    s = mf.summarize(res, kinds)
    assert s["short"] == {"n": 2, "ttft_p50_ms": 30.0, "ttft_p90_ms": 30.0}
    assert s["long"]["ttft_p50_ms"] == 100.0 and s["followup"]["n"] == 0
    assert s["throughput_rps"] == 2.0
    assert s["decisions"] == {"pd:long_uncached": 2.0, "aggregated:short_uncached": 2.0}
    assert "ttft_ms_by_rid" not in res


def test_probe_summary_sets_pd_ttft_against_the_prefill_and_names_long_routes() -> None:
    rows = {0: {"kind": "short", "direct": True, "ttft_ms": 10.0},
            1: {"kind": "long", "where": "prefill-0", "shape": "pd", "ttft_ms": 300.0},
            2: {"kind": "long", "where": "prefill-1", "shape": "pd", "ttft_ms": 500.0},
            3: {"kind": "opener", "where": "prefill-0", "shape": "pd", "ttft_ms": 400.0},
            4: {"kind": "short", "error": "TimeoutError: "}}
    run = {"rows": rows, "prefill_calls": 3.0, "prefill_mean_ms": 350.0}
    s = mp.summary(run)
    assert s["long"] == {"n": 2, "p50": 500.0, "mean": 400.0} and s["errors"] == 1
    # the direct short prompt is no PD request: three PD TTFTs, 400 ms mean, 50 outside
    assert s["pd_ttft_mean_ms"] == 400.0 and s["pd_outside_prefill_ms"] == 50.0
    assert s["long_where"] == {"prefill-0": 1, "prefill-1": 1} and s["long_shapes"] == ["pd"]
    other = {"rows": {1: {"kind": "long", "where": "prefill-1"}, 2: {"kind": "long"}}}
    assert mp.long_routes({"a": run, "b": other}) == {
        1: {"a": "prefill-0", "b": "prefill-1"}, 2: {"a": "prefill-1", "b": None}}


def test_cluster_rejects_hiding_outside_a_mixed_fleet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hide"):
        rc.Cluster(argparse.Namespace(), "127.0.0.1:1", "/x", tmp_path, "pd", hide="pd")
    with pytest.raises(ValueError, match="fleet"):
        rc.Cluster(argparse.Namespace(), "127.0.0.1:1", "/x", tmp_path, "monolith")


def test_aggregated_fleet_caches_a_shared_prefix_through_kv_aware(etcd_endpoint: str,
                                                                   tmp_path: Path) -> None:
    # two turns of one conversation, then a second conversation on the same system prompt:
    # kv_aware must send the later ones to the aggregated engine holding the prefix
    system = "<|system|>\nshared: " + "kernel cache route token " * 20
    texts = [system + "q1", system + "q1 a1 q2", system + "other"]
    reqs = [rt.Req(i, t, 2, session="s") for i, t in enumerate(texts)]
    args = argparse.Namespace(prefills=2, prefill_pages=64, decode_pages=256, concurrency=1,
                              request_timeout=60.0, kvatlas_arg=[], sglang_arg=[])
    res = rc.run_router(args, etcd_endpoint, "kv_aware", 0, tmp_path, reqs, fleet="aggregated")
    assert res["errors"] == 0 and res["ok"] == 3, res.get("error_samples")
    assert [row["instance"] for row in res["per_instance"]] == ["agg-0", "agg-1"]
    assert res["prompt_tokens"] == sum(len(rt.prompt_tokens(t)) for t in texts)
    # the system prompt is 32 blocks: both later requests find at least 30 of them cached
    assert res["cached_tokens"] >= 2 * 30 * rt.BLOCK, res["per_instance"]
    assert res["fleet"] == "aggregated" and len(res["ttft_ms_by_rid"]) == 3
