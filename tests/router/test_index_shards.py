"""A router following a block index spread over two real etcd clusters (``--index-etcd``):
it routes on both shards' blocks, and when one shard's etcd dies it says so per shard in
/readiness and the metrics while the other shard stays live."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from etcd_block_index import EtcdBlockIndex
from etcd_instances import wait_for
from router_stubs import encode_text
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.hashing import block_hashes
from index.shards import IndexShards
from kvatlas.etcd_proc import EtcdCluster
from router.config import RouterConfig

SYSTEM = "You are kvatlas, a careful assistant. Answer briefly and cite sources. " * 4


def first_on(shards: IndexShards, shard: int) -> str:
    return next(f"p{k}" for k in range(1000) if shards.place(f"p{k}") == shard)


@pytest.fixture
async def shard_indexes(etcd_endpoint: str, etcd_shard: EtcdCluster, key_prefix: str,
                        layout: Any) -> AsyncIterator[tuple[IndexShards, list[EtcdBlockIndex]]]:
    """Two shards (the session's etcd and one of this test's own), each with a writer of
    blocks (``EtcdBlockIndex``: instances' writers under leases of that shard's etcd)."""
    shards = IndexShards.from_texts([etcd_endpoint, etcd_shard.endpoints],
                                    EtcdSettings(timeout=2.0))
    async with contextlib.AsyncExitStack() as stack:
        indexes = []
        for c in shards.clusters:
            client = EtcdClient(c)
            stack.push_async_callback(client.close)
            index = EtcdBlockIndex(client, layout, "tiny", lease_ttl=5)
            await index.start()
            stack.push_async_callback(index.close)
            indexes.append(index)
        yield shards, indexes
        async with EtcdClient(shards.clusters[0]) as client:
            await client.delete(key_prefix.encode() + b"/", prefix=True)


async def test_routes_on_every_shard_and_flags_the_one_that_is_down(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any, register: Any,
        shard_indexes: Any, etcd_shard: EtcdCluster) -> None:
    shards, indexes = shard_indexes
    a, b = first_on(shards, 0), first_on(shards, 1)
    (pa, pb), (d,) = await stubs("prefill", 2), await stubs("decode")
    await register(a, {"role": "prefill", "url": pa.url, "model": "tiny"})
    await register(b, {"role": "prefill", "url": pb.url, "model": "tiny"})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    prompt_a, prompt_b = "Shard zero. " + SYSTEM, "Shard one. " + SYSTEM
    ha, hb = (block_hashes(encode_text(p), 16) for p in (prompt_a, prompt_b))
    await indexes[0].add(a, None, ha[:10])
    await indexes[1].add(b, None, hb[:10])
    await indexes[0].settle()
    await indexes[1].settle()

    client = await start_router(RouterConfig(
        etcd=etcd_settings, etcd_prefix=key_prefix, model="tiny", health_interval=60,
        index_etcd=shards))

    async def routed(prompt: str, holder: str, blocks: int) -> Any:
        resp = await client.post("/debug/route", json={"text": prompt})
        body = await resp.json() if resp.status == 200 else None
        ok = body is not None and body["prefill"]["instance_id"] == holder \
            and body["index_blocks"] == blocks
        return body if ok else None

    await wait_until(lambda: routed(prompt_a, a, 10), what="prompt a routed to its holder, shard 0")
    body = await wait_until(lambda: routed(prompt_b, b, 10),
                            what="prompt b routed to its holder, shard 1")
    index = body["index"]
    assert index["state"] == "live" and index["stale_shards"] == []
    assert [(s["shard"], s["state"], s["instances"], s["blocks"]) for s in index["shards"]] == [
        (0, "live", 1, 10), (1, "live", 1, 10)]
    assert index["shards"][1]["endpoint"] == etcd_shard.endpoints

    etcd_shard.members[0].kill()

    async def flagged() -> Any:
        resp = await client.get("/readiness")
        body = await resp.json()
        return body if body["index"].get("stale_shards") == [1] else None

    ready = await wait_until(flagged, what="readiness to flag shard 1 stale")
    # Routing goes on (200), shard 1 is flagged, shard 0 is live.
    assert ready["status"] == "ready" and ready["index"]["state"] == "stale"
    assert [s["state"] for s in ready["index"]["shards"]] == ["live", "stale"]
    metrics = await (await client.get("/metrics")).text()
    assert (f'kvatlas_router_index_shard_state{{endpoint="{etcd_shard.endpoints}",shard="1"}} '
            "1.0") in metrics
    assert 'kvatlas_router_index_shard_state{endpoint="' in metrics and 'shard="0"} 0.0' in metrics
    assert "kvatlas_router_index_stale 1.0" in metrics
    # Shard 1's instance is routed on its last known blocks; shard 0 still takes new ones.
    assert await routed(prompt_b, b, 10)
    await indexes[0].add(a, ha[9], ha[10:14])
    await wait_for(lambda: routed(prompt_a, a, 14), 10)


def test_index_etcd_without_etcd_is_refused() -> None:
    shards = IndexShards.from_texts(["127.0.0.1:2379"], EtcdSettings())
    with pytest.raises(ValueError, match="--index-etcd needs --etcd"):
        RouterConfig(index_etcd=shards)
