"""Several routers over one cluster, with real processes: each finds the workers through etcd
alone, so a client that retries on another router loses no request when one is killed under
traffic."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from conftest import SidecarCluster, start_cluster

pytestmark = pytest.mark.slow

SYSTEM = "Several routers share one index: a shared prefix that any of them can find. " * 2
TIMEOUT = 30.0


async def ask(session: aiohttp.ClientSession, urls: list[str], text: str, first: int
              ) -> tuple[int, int, float]:
    """POST to ``urls[first]``, on a transport error retry on the next router; returns
    (status, tries, seconds)."""
    t0 = time.monotonic()
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    for tries in range(1, len(urls) + 1):
        url = urls[(first + tries - 1) % len(urls)]
        try:
            async with session.post(f"{url}/generate", json=body) as resp:
                await resp.read()
                if resp.status == 200 or tries == len(urls):
                    return resp.status, tries, time.monotonic() - t0
        except (aiohttp.ClientError, TimeoutError):
            if tries == len(urls):
                return 0, tries, time.monotonic() - t0
    return 0, len(urls), time.monotonic() - t0


async def test_a_killed_router_loses_no_request_of_a_client_that_retries(
        etcd_endpoint: str, own_cluster: list[SidecarCluster]) -> None:
    cluster = start_cluster(etcd_endpoint, routers=2)
    own_cluster.append(cluster)
    urls = [cluster.router.url, cluster.extra[0].url]
    outcomes: list[tuple[int, int, float]] = []
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        status, _, _ = await ask(s, urls, SYSTEM + "first", 0)
        assert status == 200
        tasks = []
        for i in range(60):
            tasks.append(asyncio.create_task(ask(s, urls, f"{SYSTEM}request {i}", i % 2)))
            if i == 20:
                cluster.router.kill()  # router 0 dies under traffic
            await asyncio.sleep(0.05)
        outcomes = list(await asyncio.gather(*tasks))
    assert all(status == 200 for status, _, _ in outcomes), outcomes
    assert any(tries > 1 for _, tries, _ in outcomes)  # some did fail over
    assert max(seconds for _, _, seconds in outcomes) < TIMEOUT
