"""kv_aware end to end: blocks written by the real writer (EtcdBlockIndex), followed by the
router's real BlockMirror, steer requests to the instance holding the longest prefix."""
from __future__ import annotations

from typing import Any

import pytest
from etcd_block_index import EtcdBlockIndex
from etcd_instances import wait_for
from router_stubs import encode_text

from index.hashing import block_hashes
from router.config import RouterConfig

SYSTEM = "You are kvatlas, a careful assistant. Answer briefly and cite sources. " * 4


@pytest.mark.parametrize("router_model", ["tiny", None], ids=["--model", "no-model"])
async def test_routes_to_longest_prefix_holder(start_router: Any, etcd: Any, layout: Any,
                                               etcd_settings: Any, key_prefix: str,
                                               stubs: Any, register: Any,
                                               router_model: str | None) -> None:
    # Without --model, a request naming no model means the one model the pools serve.
    prefills, (d,) = await stubs("prefill", 3), await stubs("decode")
    instances = [await register(f"p{i}", {"role": "prefill", "url": s.url, "model": "tiny"})
                 for i, s in enumerate(prefills)]
    instances.append(await register("d0", {"role": "decode", "url": d.url, "model": "tiny"}))
    index = EtcdBlockIndex(etcd, layout, "tiny")
    await index.start()
    try:
        await check_routing(start_router, etcd_settings, key_prefix, index, prefills, d,
                            instances, router_model)
    finally:
        await index.close()


async def check_routing(start_router: Any, etcd_settings: Any, key_prefix: str,
                        index: EtcdBlockIndex, prefills: Any, d: Any, instances: Any,
                        router_model: str | None = "tiny") -> None:
    prompt = SYSTEM + "What is etcd?"
    hashes = block_hashes(encode_text(prompt), 16)
    await index.add("p2", None, hashes[:12])
    await index.add("p1", None, hashes[:3])
    await index.settle()

    client = await start_router(RouterConfig(
        etcd=etcd_settings, etcd_prefix=key_prefix, model=router_model, health_interval=60))

    async def decided() -> Any:
        resp = await client.post("/debug/route", json={"text": prompt})
        if resp.status != 200:
            return None
        body = await resp.json()
        return body if body["matched_blocks"] == 12 else None

    await wait_for(decided)
    body = await decided()
    assert body["prefill"]["instance_id"] == "p2" and body["prefill"]["url"] == prefills[2].url
    assert body["decode"]["instance_id"] == "d0"
    cands = {c["instance_id"]: c for c in body["candidates"]}
    assert cands["p1"]["matched_blocks"] == 3 and cands["p0"]["matched_blocks"] == 0
    assert cands["p2"]["cost"] < cands["p1"]["cost"] < cands["p0"]["cost"]
    assert body["index"]["state"] == "live" and body["index"]["blocks"] == 12
    assert not any(s.bodies for s in prefills) and not d.bodies  # debug sends nothing

    for _ in range(3):
        assert (await client.post("/generate", json={"text": prompt})).status == 200
    assert len(prefills[2].bodies) == 3
    metrics = await (await client.get("/metrics")).text()
    # First request: 12 indexed blocks; the next two also hit the router's own prediction of
    # all 18 blocks routed to p2 a moment before.
    assert f"kvatlas_router_prefix_hit_tokens_total {(12 + 18 + 18) * 16}.0" in metrics
    assert "kvatlas_router_predicted_blocks 18.0" in metrics
    assert 'kvatlas_router_routing_decisions_total{instance="p2",role="prefill"} 3.0' in metrics
    assert "kvatlas_router_index_ready 1.0" in metrics
    # An unrelated prompt (no full block) falls back to load.
    resp = await client.post("/v1/completions", json={"prompt": "unrelated", "model": "tiny"})
    assert resp.status == 200

    # The holder dies: its blocks leave with its lease and routing moves on.
    await index.drop("p2", revoke=True)
    await instances[2].stop()

    async def moved() -> Any:
        resp = await client.post("/debug/route", json={"text": prompt})
        body = await resp.json()
        return resp.status == 200 and body["prefill"]["instance_id"] == "p1" \
            and body["matched_blocks"] == 3

    await wait_for(moved)


async def test_burst_sticks_before_events_arrive(start_router: Any, stubs: Any) -> None:
    prefills, (d,) = await stubs("prefill", 4), await stubs("decode")
    client = await start_router(RouterConfig(
        prefill=[(p.url, None) for p in prefills], decode=[d.url], health_interval=60,
        tokenizers={None: "byte"}))
    prompt = SYSTEM + "burst"
    for _ in range(8):
        assert (await client.post("/generate", json={"text": prompt})).status == 200
    # No index at all: only the router's own prediction keeps the burst on one instance.
    assert sorted(len(p.bodies) for p in prefills) == [0, 0, 0, 8]
