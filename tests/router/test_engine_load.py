"""Engine-reported load: the router reads SGLang's, vLLM's and kvatlas's /metrics, counts the
work it did not send into kv_aware's cost, and keeps busy workers out of the choice while
another is free; the thresholds change at run time through the admin API."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from router_stubs import encode_text

from index.table import BlockTable
from router.breaker import CircuitBreaker
from router.config import RouterConfig
from router.engine_load import EngineLoad, Thresholds, parse_metrics
from router.kv_aware import KvAware
from router.policy import RouteContext
from router.workers import Worker

SGLANG = """# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 7.0
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 3.0
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-0.6B",tp_rank="0"} 0.42
sglang:cache_hit_rate{model_name="Qwen/Qwen3-0.6B"} 0.5
"""
VLLM = """vllm:num_requests_waiting{engine="0",model_name="m a"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m a"} 3.0
vllm:num_requests_running{engine="0",model_name="m a"} 4.0 1712345678000
vllm:kv_cache_usage_perc{engine="0",model_name="m a"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m a"} 0.75
"""
KVATLAS = """kvatlas_engine_queue_length 1.0
kvatlas_engine_running_requests 2.0
kvatlas_engine_kv_pages_used 256.0
kvatlas_engine_kv_pages_total 1024.0
"""


def test_each_engines_metrics_are_read() -> None:
    assert parse_metrics(SGLANG, 5.0) == EngineLoad(7.0, 3.0, 0.42, 5.0)
    # per DP engine: queues summed, usage the fullest (label values may hold spaces)
    assert parse_metrics(VLLM) == EngineLoad(5.0, 4.0, 0.75, 0.0)
    assert parse_metrics(KVATLAS) == EngineLoad(1.0, 2.0, 0.25, 0.0)
    assert parse_metrics("# nothing we know\nother_metric 1\n") is None
    assert parse_metrics("sglang:num_queue_reqs NaN\nsglang:num_queue_reqs{a=\"b\"} x\n") is None


def test_thresholds() -> None:
    th = Thresholds(busy_queue=5, busy_kv_usage=0.9)
    assert th.busy(EngineLoad(5, 0, None, 0)) and th.busy(EngineLoad(0, 0, 0.95, 0))
    assert not th.busy(EngineLoad(4, 9, 0.5, 0)) and not th.busy(None)
    for bad in ({"busy_queue": 0}, {"busy_queue": True}, {"busy_kv_usage": 1.5},
                {"busy_kv_usage": "0.5"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Thresholds(**bad)  # type: ignore[arg-type]


def test_unseen_engine_work_counts_in_the_cost() -> None:
    """Another router's requests queued at p0 make it dearer than its prefix saves."""
    table = BlockTable()
    ws = [Worker(f"p{i}", "prefill", f"http://127.0.0.1:{9000 + i}", CircuitBreaker())
          for i in range(2)]
    t = [100.0]
    kv = KvAware(RouterConfig(), lambda h, m: table.lookup(h), random.Random(1),
                 clock=lambda: t[0])
    text = "<|system|>\n" + "a prompt with a shared prefix " * 6
    hashes = RouteContext(encode_text(text)).hashes(kv.hasher, kv.seed)
    table.apply_add("p0", hashes[:3])
    assert kv.select(ws, RouteContext(encode_text(text))).worker.instance_id == "p0"
    kv.mean_work = 4.0
    ws[0].engine = EngineLoad(queue=4, running=1, kv_usage=0.5, at=99.5)  # 4 queued x 4 blocks
    choice = kv.select(ws, RouteContext(encode_text(text)))
    assert choice.worker.instance_id == "p1"
    cost = {c["instance_id"]: c for c in choice.candidates}
    assert cost["p0"]["load_blocks"] == 16.0
    ws[0].load = 5  # one running and four queued, all this router's own: nothing unseen
    assert kv._unseen_work(ws[0], 100.0) == 0.0
    ws[0].load = 1  # its one request is the running one: the queue is someone else's
    assert kv._unseen_work(ws[0], 100.0) == 16.0
    ws[0].engine = EngineLoad(queue=0, running=6, kv_usage=0.5, at=99.5)
    assert kv._unseen_work(ws[0], 100.0) == 0.0  # running requests do not hold a new one up
    t[0] = 110.0  # a reading older than three intervals is ignored
    ws[0].load = 0
    assert kv._unseen_work(ws[0], 110.0) == 0.0


async def test_busy_workers_are_left_out_and_thresholds_change_at_run_time(
        stubs: Any, make_router: Any) -> None:
    ps, (d,) = await stubs("prefill", 2), await stubs("decode")
    ps[0].metrics_text = "sglang:num_queue_reqs 12\nsglang:num_running_reqs 4\n"
    ps[1].metrics_text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 1\n"
    client = await make_router(ps, [d], policy="round_robin", busy_queue=10,
                               load_interval=0.05, admin_token="secret-admin")
    for _ in range(100):  # the first scrape
        workers = await (await client.get("/workers")).json()
        if all(w["engine"] for w in workers["prefill"]):
            break
        await asyncio.sleep(0.02)
    for i in range(6):
        assert (await client.post("/generate", json={"text": f"q{i}"})).status == 200
    assert len(ps[0].bodies) == 0 and len(ps[1].bodies) == 6
    lines = await client.metric_lines("kvatlas_router_busy_workers")
    assert 'kvatlas_router_busy_workers{role="prefill"} 1.0' in lines
    queue = await client.metric_lines("kvatlas_router_engine_queue")
    assert any(ln.endswith(" 12.0") for ln in queue)
    # The admin API: the token, then bad values named, then the change.
    assert (await client.put("/admin/thresholds", json={"busy_queue": None})).status == 401
    auth = {"Authorization": "Bearer secret-admin"}
    for bad, field in (({"busy_queue": 0}, "busy_queue"), ({"busy_kv_usage": 2}, "busy_kv_usage"),
                       ({"queue": 3}, "queue"), ([1], "")):
        resp = await client.put("/admin/thresholds", json=bad, headers=auth)
        assert resp.status == 400, bad
        assert (await resp.json())["error"].startswith(field), await resp.json()
    resp = await client.put("/admin/thresholds", json={"busy_queue": None}, headers=auth)
    assert resp.status == 200 and await resp.json() == {"busy_queue": None,
                                                        "busy_kv_usage": None,
                                                        "disagg_tokens": 512}
    assert await (await client.get("/admin/thresholds")).json() == {"busy_queue": None,
                                                                    "busy_kv_usage": None,
                                                                    "disagg_tokens": 512}
    for i in range(4):
        assert (await client.post("/generate", json={"text": f"r{i}"})).status == 200
    assert len(ps[0].bodies) == 2  # round robin again over both


async def test_when_every_worker_is_busy_the_request_still_goes(stubs: Any,
                                                               make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.metrics_text = "vllm:num_requests_waiting 50\nvllm:kv_cache_usage_perc 0.99\n"
    client = await make_router([p], [d], busy_kv_usage=0.95, load_interval=0.05)
    for _ in range(100):
        if (await (await client.get("/workers")).json())["prefill"][0]["engine"]:
            break
        await asyncio.sleep(0.02)
    assert (await client.post("/generate", json={"text": "still served"})).status == 200
    lines = await client.metric_lines("kvatlas_router_busy_fallbacks_total")
    assert lines == ['kvatlas_router_busy_fallbacks_total{role="prefill"} 1.0']
