"""Killing a sidecar'd engine under traffic: its sidecar marks it unhealthy (routers stop
choosing it) within 3 s and revokes its lease after the grace (record and blocks gone), and no
request waits longer than the router's timeout."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from conftest import SidecarCluster, start_cluster

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.record import InstanceRecord
from index.segments import held_blocks

pytestmark = pytest.mark.slow

ROUTER_TIMEOUT = 30.0  # sidecar_procs.Router's --request-timeout-secs
GRACE = 2.0  # sidecar_procs.sidecar's --unhealthy-grace
SYSTEM = "A shared system prompt for the traffic of the kill test, long enough for blocks. "


async def traffic(url: str, stop: asyncio.Event, outcomes: list[tuple[float, int, float]]
                  ) -> None:
    """Requests at ~10/s until ``stop``; each outcome as (start, status, seconds)."""
    timeout = aiohttp.ClientTimeout(total=ROUTER_TIMEOUT + 15)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def one(i: int) -> None:
            t0 = time.monotonic()
            body = {"text": f"{SYSTEM}request {i}", "sampling_params": {
                "max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True}}
            try:
                async with s.post(f"{url}/generate", json=body) as resp:
                    await resp.read()
                    status = resp.status
            except (TimeoutError, aiohttp.ClientError):
                status = 0
            outcomes.append((t0, status, time.monotonic() - t0))
        tasks = []
        i = 0
        while not stop.is_set():
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(0.1)
        await asyncio.gather(*tasks)


async def test_killing_an_engine_under_traffic_takes_it_out_of_routing(
        etcd_endpoint: str, own_cluster: list[SidecarCluster]) -> None:
    cluster = start_cluster(etcd_endpoint)
    own_cluster.append(cluster)
    layout = KeyLayout(cluster.prefix)
    victim = cluster.prefills[0]
    stop = asyncio.Event()
    outcomes: list[tuple[float, int, float]] = []
    load = asyncio.create_task(traffic(cluster.router.url, stop, outcomes))
    async with EtcdClient(EtcdSettings.from_text(etcd_endpoint)) as etcd:
        async def record() -> InstanceRecord | None:
            kv = await etcd.get(layout.instance(victim.name))
            return None if kv is None else InstanceRecord.from_json(kv.value)

        async def blocks() -> int:
            _, kvs = await etcd.get_prefix(layout.blocks_prefix("tiny", victim.name))
            return len(held_blocks(kv.value for kv in kvs))

        await asyncio.sleep(2.0)
        assert await blocks() > 0, cluster.logs()  # it served and its events were indexed
        killed = time.monotonic()
        victim.kill()
        unhealthy = gone = None
        while time.monotonic() - killed < 15:
            rec = await record()
            now = time.monotonic() - killed
            if unhealthy is None and (rec is None or not rec.healthy):
                unhealthy = now
            if rec is None and await blocks() == 0:
                gone = now
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)  # traffic after the kill
        stop.set()
        await load
    print(f"unhealthy in its record {unhealthy} s after the kill, record and blocks gone after "
          f"{gone} s; {len(outcomes)} requests")
    assert unhealthy is not None and unhealthy <= 3.0, (unhealthy, cluster.logs())
    assert gone is not None and gone <= 3.0 + GRACE + 1.0, gone
    after = [o for o in outcomes if o[0] > killed + 3.0]
    assert after and all(status == 200 for _, status, _ in after), after
    hung = [o for o in outcomes if o[1] == 0 or o[2] > ROUTER_TIMEOUT]
    assert not hung, hung
    router_view = await workers(cluster.router.url)
    assert victim.name not in [w["instance_id"] for w in router_view["prefill"]
                               if w.get("source") == "etcd"]


async def workers(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/workers") as resp:
            return await resp.json()  # type: ignore[no-any-return]
