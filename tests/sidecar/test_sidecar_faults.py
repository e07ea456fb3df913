"""Killing a sidecar'd engine under traffic: its sidecar marks it unhealthy (routers stop
choosing it), then revokes its lease after the grace (record and blocks gone), and every
request gets an answer (none is left hanging)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from conftest import SidecarCluster, start_cluster
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.record import InstanceRecord
from index.segments import held_blocks

pytestmark = pytest.mark.slow

ROUTER_TIMEOUT = 30.0  # sidecar_procs.Router's --request-timeout-secs
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
            await asyncio.sleep(0.1)  # the traffic's pace (~10 requests a second), not a wait
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

        # It served and its events were indexed.
        await wait_until(blocks, what="the victim's blocks are indexed", detail=cluster.logs)
        victim.kill()

        async def unhealthy() -> bool:
            rec = await record()
            return rec is None or not rec.healthy

        async def gone() -> bool:
            return await record() is None and await blocks() == 0
        await wait_until(unhealthy, what="the victim's record says unhealthy",
                         detail=cluster.logs)
        await wait_until(gone, what="the victim's record and blocks leave etcd",
                         detail=cluster.logs)
        left = time.monotonic()
        # Traffic after it left routing: 10 requests started since then, all answered.
        await wait_until(lambda: sum(o[0] > left for o in outcomes) >= 10,
                         what="10 requests after the victim left are answered",
                         detail=lambda: outcomes[-3:])
        stop.set()
        await load
    after = [o for o in outcomes if o[0] > left]
    assert after and all(status == 200 for _, status, _ in after), after
    hung = [o for o in outcomes if o[1] == 0]  # no answer within ROUTER_TIMEOUT + 15 s
    assert not hung, hung
    router_view = await workers(cluster.router.url)
    assert victim.name not in [w["instance_id"] for w in router_view["prefill"]
                               if w.get("source") == "etcd"]


async def workers(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/workers") as resp:
            return await resp.json()  # type: ignore[no-any-return]
