"""Restarts: the router rebuilds its pools and index from etcd; a prefill restarted with the
same id replaces its old rank addresses, decodes reconnect to it and its events resync."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest
from fault_helpers import (
    LEASE_TTL,
    SYSTEM,
    Traffic,
    answered,
    assert_reference_tokens,
    etcd_keys,
    generate,
    get_json,
    route,
    sampling,
    wait_for,
)

from engine.protocol import encode_text
from index.etcd import EtcdClient
from index.hashing import DEFAULT_BLOCK_SIZE, block_hashes
from index.keys import KeyLayout, loads
from index.segments import held_blocks
from kvatlas.launcher.supervisor import LocalCluster

pytestmark = pytest.mark.timeout(90)


async def test_router_restart_rebuilds_from_etcd(pd_cluster: Callable[..., LocalCluster]) -> None:
    cluster = pd_cluster()
    router = cluster.state.router["url"]
    for q in range(4):
        await generate(router, SYSTEM + f"warm-up {q}?")
    _, before = await get_json(f"{router}/readiness")
    blocks = before["index"]["blocks"]
    assert blocks > 0
    expected = (await route(router, SYSTEM + "next?"))["prefill"]["instance_id"]

    cluster.kill("router")
    traffic = Traffic(router, rate=5.0)
    cluster.launch(cluster.service("router"))

    async def rebuilt() -> bool:
        try:
            status, ready = await get_json(f"{router}/readiness")
        except aiohttp.ClientError:
            return False  # not listening yet
        return (status == 200 and ready["prefill"]["available"] == 2
                and ready["decode"]["available"] == 1 and ready["index"]["state"] == "live"
                and ready["index"]["blocks"] >= blocks)

    # Waited for, not timed: how fast it comes back is bench/load.py's router_rebuild_s.
    await wait_for(rebuilt, 30.0, interval=0.05, what="the restarted router rebuilt its view")
    assert (await route(router, SYSTEM + "next?"))["prefill"]["instance_id"] == expected
    traffic.start()
    await traffic.until_answered(15, "after the router restart")
    outcomes = await traffic.stop()
    assert outcomes and all(o.status == 200 for o in outcomes), \
        [(o.status, o.error) for o in outcomes if o.status != 200][:3]
    assert_reference_tokens(outcomes)


async def _rank_records(cluster: LocalCluster, iid: str) -> list[dict[str, object]]:
    layout = KeyLayout()
    async with EtcdClient(cluster.state.etcd_settings(timeout=3)) as client:
        _, kvs = await client.get_prefix(layout.ranks_prefix(iid))
        inst = await client.get(layout.instance(iid))
    return [{**loads(kv.value), "lease": kv.lease} for kv in kvs] + \
        ([{"instance_lease": inst.lease}] if inst else [])


async def _restart_victim(cluster: LocalCluster) -> str:
    """Kill and restart (same id, same ports) the prefill that holds a prefix; wait until its
    old keys are replaced and the router sees it ready again. Returns its id."""
    state = cluster.state
    router = state.router["url"]
    await generate(router, SYSTEM + "before the restart?")
    victim = (await route(router, SYSTEM + "x?"))["prefill"]["instance_id"]
    old = await _rank_records(cluster, victim)
    assert old and (await etcd_keys(state, victim))["blocks"] > 0

    cluster.kill(victim)
    cluster.restart(victim)

    async def replaced() -> bool:
        now = await _rank_records(cluster, victim)
        return bool(now) and all(r["lease"] != old[0]["lease"] for r in now if "lease" in r) \
            and now[-1].get("instance_lease") not in (None, old[-1].get("instance_lease"))

    # The old keys go with the old lease; the new registration holds only new-lease keys.
    await wait_for(replaced, LEASE_TTL + 5.0, interval=0.2, what="the instance is replaced")

    async def resynced_empty() -> bool:
        # The restarted instance's cache is empty: its old blocks leave the index.
        return (await etcd_keys(state, victim))["blocks"] == 0

    await wait_for(resynced_empty, LEASE_TTL + 5.0, interval=0.2,
                   what="the index resynced to empty")

    async def router_sees_it() -> bool:
        _, workers = await get_json(f"{router}/workers")
        return any(w["instance_id"] == victim and w["ready"] and w["healthy"]
                   for w in workers["prefill"])

    await wait_for(router_sees_it, 15.0, interval=0.2, what="the router sees the instance")
    return victim


async def test_prefill_restart_same_id_replaces_keys_and_resyncs(
        pd_cluster: Callable[..., LocalCluster]) -> None:
    cluster = pd_cluster()
    router = cluster.state.router["url"]
    await _restart_victim(cluster)
    # Clients retry through the router: every request succeeds, and the events of the new
    # instance's cache reach the index again.
    prompt = SYSTEM + "after the restart?"
    for _ in range(3):
        await generate(router, prompt, timeout=60)

    # The prompt's own last full block, as the prefill that served it indexes it: it can only be
    # in etcd if that prefill's cache events flowed after the restart.
    last_block = block_hashes(encode_text(prompt, "text"), DEFAULT_BLOCK_SIZE)[-1]
    layout = KeyLayout()

    async def events_resynced() -> bool:
        settings = cluster.state.etcd_settings(timeout=3.0)
        async with EtcdClient(settings) as client:
            for instance in ("prefill-0", "prefill-1"):
                _, kvs = await client.get_prefix(layout.blocks_prefix(cluster.state.model,
                                                                      instance))
                if last_block in held_blocks(kv.value for kv in kvs):
                    return True
        return False

    await wait_for(events_resynced, 10.0, interval=0.2, what="the KV events resynced")


async def test_decode_reconnects_to_a_restarted_prefill(
        pd_cluster: Callable[..., LocalCluster]) -> None:
    cluster = pd_cluster()
    state = cluster.state
    victim = await _restart_victim(cluster)
    boot = state.process(victim).ports["bootstrap"]
    decode = state.by_role("decode")[0].url
    room = 424242
    prompt = SYSTEM + "straight to the restarted instance?"
    body = {"text": prompt, "sampling_params": sampling(),
            "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": room}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        async def post(url: str) -> tuple[int, object]:
            async with s.post(f"{url}/generate", json=body) as resp:
                return resp.status, await resp.json(content_type=None)
        answers = await asyncio.gather(post(state.process(victim).url), post(decode),
                                       return_exceptions=True)
    status, doc = await get_json(f"{decode}/debug/rooms/{room}")
    statuses = [a[0] if isinstance(a, tuple) else a for a in answers]
    assert statuses == [200, 200] and status == 200 and doc["stage"] == "consumed", (statuses, doc)
    assert isinstance(answers[1], tuple)
    assert_reference_tokens([answered(prompt, answers[1][1])])
