"""Index guards: an instance whose block size, hash namespace or tokenizer differs from the
router's has its index entries ignored, named in a log line, a gauge and /debug/index_health.
Real pools and metrics first; then real etcd records, a real block writer and the router's
real mirror."""
from __future__ import annotations

import logging
from typing import Any

import pytest
from etcd_block_index import EtcdBlockIndex
from etcd_instances import wait_for
from router_stubs import encode_text

from index.hashing import BASE_SEED, block_hashes, namespace_seed
from router.config import RouterConfig
from router.index_guards import (
    BLOCK_SIZE,
    HASH_NAMESPACE,
    ROUTER_NAMESPACE,
    TOKENIZER,
    IndexGuards,
    Mismatch,
    record_mismatches,
)
from router.metrics import RouterMetrics
from router.workers import ETCD, PREFILL, WorkerPools

SYSTEM = "You are kvatlas, a careful assistant. Answer briefly and cite sources. " * 4


def test_record_mismatches() -> None:
    assert record_mismatches({}, 16) == {}
    assert record_mismatches({"block_size": None, "hash_namespace": None}, 16) == {}
    assert record_mismatches({"block_size": 16}, 16) == {}
    assert record_mismatches({"block_size": 8}, 16) == {
        BLOCK_SIZE: Mismatch(BLOCK_SIZE, "16", "8")}
    # A namespace written out with neither field is the base one.
    assert record_mismatches({"hash_namespace": {"lora_name": None, "cache_salt": None}},
                             16) == {}
    found = record_mismatches({"hash_namespace": {"lora_name": "sql", "cache_salt": None}}, 16)
    assert found == {HASH_NAMESPACE: Mismatch(
        HASH_NAMESPACE, ROUTER_NAMESPACE, f"lora_name=sql (seed {namespace_seed('sql')})")}
    assert ROUTER_NAMESPACE == f"base (seed {BASE_SEED})"


def _setup() -> tuple[WorkerPools, IndexGuards, RouterMetrics]:
    config = RouterConfig()
    metrics = RouterMetrics()
    pools = WorkerPools(config)
    guards = IndexGuards(config, metrics)
    pools.listeners.append(guards.on_worker)
    return pools, guards, metrics


def _gauges(metrics: RouterMetrics) -> list[str]:
    return [line for line in metrics.render().decode().splitlines()
            if line.startswith("kvatlas_router_index_ignored{")]


def _add(pools: WorkerPools, iid: str, url: str, **record: Any) -> None:
    pools.add(PREFILL, url, instance_id=iid, source=ETCD, model="tiny",
              record={"instance_id": iid, **record})


def test_a_mismatched_instance_is_filtered_warned_once_and_forgiven(
        caplog: pytest.LogCaptureFixture) -> None:
    pools, guards, metrics = _setup()
    caplog.set_level(logging.WARNING, logger="router.index_guards")
    _add(pools, "p8", "http://127.0.0.1:8000", block_size=8)
    _add(pools, "p16", "http://127.0.0.1:8001", block_size=16)
    pools.add(PREFILL, "http://127.0.0.1:8002")  # static: nothing to judge
    assert guards.ignored == {"p8"}
    assert guards.filter({"p8": 5, "p16": 3, "static-127.0.0.1-8002": 1}) == {
        "p16": 3, "static-127.0.0.1-8002": 1}
    assert _gauges(metrics) == [
        'kvatlas_router_index_ignored{field="block_size",instance="p8",instance_value="8",'
        'model="tiny",router_value="16"} 1.0']
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "p8" in warned[0] and "block_size is 8" in warned[0] \
        and "router's is 16" in warned[0] and "page size 16" in warned[0]
    # The record written again, the same: no second line.
    _add(pools, "p8", "http://127.0.0.1:8000", block_size=8)
    assert len(caplog.records) == 1
    # A second field: its own line and gauge.
    _add(pools, "p8", "http://127.0.0.1:8000", block_size=8,
         hash_namespace={"lora_name": "sql", "cache_salt": None})
    assert [m.field for m in guards.mismatches("p8")] == [BLOCK_SIZE, HASH_NAMESPACE]
    assert len(caplog.records) == 2 and len(_gauges(metrics)) == 2
    # Fixed: used again, the gauges go.
    _add(pools, "p8", "http://127.0.0.1:8000", block_size=16)
    assert guards.ignored == frozenset() and _gauges(metrics) == []
    assert guards.filter({"p8": 5}) == {"p8": 5}
    # Broken again, then gone: the gauge leaves with it.
    _add(pools, "p8", "http://127.0.0.1:8000", block_size=32)
    assert guards.ignored == {"p8"}
    pools.remove(PREFILL, "p8")
    assert guards.ignored == frozenset() and _gauges(metrics) == []


def test_the_tokenizer_mismatch_comes_from_the_tokenizers() -> None:
    pools, guards, metrics = _setup()
    _add(pools, "p0", "http://127.0.0.1:8000", block_size=8)
    guards.on_tokenizer("p0", ("p0", "tiny", "aaaa", "bbbb"))
    assert [m.describe() for m in guards.mismatches("p0")] == [
        {"field": "block_size", "router": "16", "instance": "8"},
        {"field": "tokenizer", "router": "aaaa", "instance": "bbbb"}]
    # The record written again keeps the tokenizer's verdict (judged elsewhere).
    _add(pools, "p0", "http://127.0.0.1:8000", block_size=16)
    assert [m.field for m in guards.mismatches("p0")] == [TOKENIZER]
    assert len(_gauges(metrics)) == 1
    guards.on_tokenizer("p0", None)
    assert guards.ignored == frozenset() and _gauges(metrics) == []


async def _router(start_router: Any, etcd_settings: Any, key_prefix: str, **kw: Any) -> Any:
    return await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                           health_interval=60, tokenizers={None: "byte"}, **kw))


async def test_entries_of_other_block_size_or_namespace_are_not_used(
        start_router: Any, etcd: Any, layout: Any, etcd_settings: Any, key_prefix: str,
        stubs: Any, register: Any) -> None:
    prefills, (d,) = await stubs("prefill", 3), await stubs("decode")
    await register("p8", {"role": "prefill", "url": prefills[0].url, "model": "tiny",
                          "block_size": 8})
    await register("plora", {"role": "prefill", "url": prefills[1].url, "model": "tiny",
                             "block_size": 16,
                             "hash_namespace": {"lora_name": "sql", "cache_salt": None}})
    await register("p16", {"role": "prefill", "url": prefills[2].url, "model": "tiny",
                           "block_size": 16})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    prompt = SYSTEM + "Which block size?"
    hashes = block_hashes(encode_text(prompt), 16)
    index = EtcdBlockIndex(etcd, layout, "tiny")
    await index.start()
    try:
        # Entries that would match the router's hashes: only p16's may be used.
        await index.add("p8", None, hashes[:12])
        await index.add("plora", None, hashes[:10])
        await index.add("p16", None, hashes[:2])
        await index.settle()
        client = await _router(start_router, etcd_settings, key_prefix)

        async def decided() -> Any:
            resp = await client.post("/debug/route", json={"text": prompt})
            body = await resp.json()
            return body if resp.status == 200 and body["index_blocks"] == 2 else None

        await wait_for(decided, timeout=10)
        body = await decided()
        cands = {c["instance_id"]: c for c in body["candidates"]}
        assert body["prefill"]["instance_id"] == "p16"
        assert cands["p8"]["index_blocks"] == 0 and cands["plora"]["index_blocks"] == 0

        health = await (await client.get("/debug/index_health")).json()
        assert health["block_size"] == 16 and health["hash_seed"] == BASE_SEED
        inst = health["instances"]
        # The index holds their blocks; the router does not use them, and says why.
        assert inst["p8"]["index_blocks"] == 12 and inst["plora"]["index_blocks"] == 10
        assert inst["p8"]["ignored"] == [{"field": "block_size", "router": "16",
                                          "instance": "8"}]
        assert inst["plora"]["ignored"] == [{
            "field": "hash_namespace", "router": ROUTER_NAMESPACE,
            "instance": f"lora_name=sql (seed {namespace_seed('sql')})"}]
        assert inst["p16"]["ignored"] == [] and inst["d0"]["ignored"] == []
        gauge = await client.metric_lines('kvatlas_router_index_ignored{field="block_size"')
        assert gauge == ['kvatlas_router_index_ignored{field="block_size",instance="p8",'
                         'instance_value="8",model="tiny",router_value="16"} 1.0']
        assert await client.metric_lines(
            'kvatlas_router_index_ignored{field="hash_namespace",instance="plora"')
        head = await client.request("HEAD", "/debug/index_health")
        assert head.status == 200 and await head.read() == b""
    finally:
        await index.close()


async def test_a_tokenizer_mismatch_is_ignored_too(start_router: Any, etcd_settings: Any,
                                                   key_prefix: str, stubs: Any,
                                                   register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    await register("p0", {"role": "prefill", "url": p.url, "model": "tiny",
                          "tokenizer": {"source": "byte", "fingerprint": "0123456789abcdef"}})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    client = await _router(start_router, etcd_settings, key_prefix)

    async def ignored() -> Any:
        doc = await (await client.get("/debug/index_health")).json()
        return doc["instances"].get("p0", {}).get("ignored")

    await wait_for(ignored)
    (entry,) = await ignored()
    assert entry["field"] == "tokenizer" and entry["instance"] == "0123456789abcdef"
    assert client.app.state.guards.is_ignored("p0")
