"""The vLLM-PD modes of the benches: ``bench/router.py --vllm-pd`` (bench/_vllm_pd.py) and
``bench/routing_quality.py --fleet vllm-pd`` (bench/_routing_cluster.py), at toy sizes."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import pytest

from tests.bench.bench_modules import load as _load

rt = _load("_routing_trace")
_load("_router_load")
_load("_results")
_load("_routing_report")
rc = _load("_routing_cluster")
vp = _load("_vllm_pd")
rq = _load("routing_quality", "bench_routing_quality")
_load("router", "bench_router")  # its --vllm-pd entry point runs vp.run


def test_vllm_pd_http_bench_routes_every_request_as_a_pd_pair(tmp_path: Path) -> None:
    args = argparse.Namespace(duration=0.3, rounds=1, concurrency=[2])
    res = asyncio.run(vp.run(args, tmp_path))
    runs = res["runs"]
    for name in ("direct", "kvatlas", "kvatlas-rr"):
        assert "error" not in runs[name], runs[name]
        assert runs[name]["2"]["errors"] == 0 and runs[name]["2"]["requests"] > 0
    # through a router every decode request carries the prefill's answered params; the floor
    # posts straight to a decode, so none of its requests does
    assert runs["kvatlas"]["2"]["pd_share"] == 1.0
    assert runs["kvatlas-rr"]["2"]["pd_share"] == 1.0
    assert runs["direct"]["2"]["pd_share"] == 0.0
    assert runs["kvatlas"]["2"]["router_cpu_us_per_req"] > 0
    if res["vllm_proxy"] == "ok":
        assert runs["vllm-proxy"]["2"]["pd_share"] == 1.0, runs["vllm-proxy"]
        assert set(res["ratios"]) == {"kvatlas", "kvatlas-rr"}


def test_ratios_are_kvatlas_over_the_proxy_and_skip_a_failed_proxy() -> None:
    runs = {"direct": {"1": {"rps": 900.0}}, "kvatlas": {"1": {"rps": 300.0}},
            "vllm-proxy": {"1": {"rps": 200.0}}}
    assert vp.ratios(runs) == {"kvatlas": {"1": 1.5}}
    assert vp.ratios({**runs, "vllm-proxy": {"error": "not ready"}}) == {}


def test_vllm_ratios_compare_push_with_pull_per_router() -> None:
    runs = {"kv_aware": {"cached_tokens": 100, "ttft_p50_ms": 20.0},
            "round_robin": {"cached_tokens": 50, "ttft_p50_ms": 40.0},
            "kv_aware@push": {"cached_tokens": 90, "ttft_p50_ms": 10.0},
            "round_robin@push": {"error": "router did not start"}}
    out = rq.vllm_ratios(runs)
    assert out["kv_aware_push_vs_pull_ttft_p50"] == 0.5
    assert out["round_robin_push_vs_pull_ttft_p50"] is None
    assert out["kv_aware_vs_round_robin@push"] is None


def test_cluster_rejects_an_unknown_vllm_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vllm_mode"):
        rc.Cluster(argparse.Namespace(vllm_mode="pipe"), "127.0.0.1:1", "/x", tmp_path,
                   "vllm-pd")


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_vllm_pd_fleet_caches_a_shared_prefix_through_kv_aware(etcd_endpoint: str,
                                                              tmp_path: Path, mode: str) -> None:
    # a conversation's second turn and a second conversation on its system prompt, through a
    # vLLM-protocol fleet: kv_aware must send the later ones to the prefill holding the prefix
    system = "<|system|>\nshared: " + "kernel cache route token " * 20
    texts = [system + "q1", system + "q1 a1 q2", system + "other"]
    reqs = [rt.Req(i, t, 2, session="s") for i, t in enumerate(texts)]
    # At the default overlap weight (2) a later turn saves ~2 x 32 blocks at the holder
    # against its recent work (~33 blocks, decaying). A push prefill's call stays open until
    # its KV is sent, often past the end of the decode's stream: the router stops counting it
    # as running at the decode's first byte, or a turn sent right after the last would see the
    # holder still running it too and lose it by a hair. Predictions bridge the index's lag
    # for a loaded machine's seconds.
    args = argparse.Namespace(prefills=2, prefill_pages=64, decode_pages=256, concurrency=1,
                              request_timeout=60.0, sglang_arg=[], vllm_mode=mode,
                              kvatlas_arg=["--prediction-catch-up", "60"])
    res = rc.run_router(args, etcd_endpoint, "kv_aware", 0, tmp_path, reqs, fleet="vllm-pd")
    assert res["errors"] == 0 and res["ok"] == 3, res.get("error_samples")
    assert res["fleet"] == "vllm-pd" and res["vllm_mode"] == mode
    assert res["prompt_tokens"] == sum(len(rt.prompt_tokens(t)) for t in texts)
    assert res["cached_tokens"] >= 2 * 30 * rt.BLOCK, res["per_instance"]
