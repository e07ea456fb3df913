"""Several routers over one cluster, with real processes: each finds the workers through etcd
alone, so a client that retries on another router loses no request when one is killed under
traffic; and they share their routing predictions, so a conversation's next turn finds its
holder through any router before the engines' KV events do."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from conftest import SidecarCluster, start_cluster
from sidecar_procs import Engine, Router
from waiting import wait_until

from kvatlas.etcd_proc import free_port

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


def _no_events(engine: Engine) -> tuple[str, ...]:
    # The sidecar binds an endpoint nobody publishes to: the index stays empty, so only
    # predictions can tell a router where a prompt went.
    if engine.mode != "prefill":
        return ()
    return ("--kv-events", f"tcp://127.0.0.1:{free_port()}", "--publisher-wait", "0")


async def routed(session: aiohttp.ClientSession, url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    async with session.post(f"{url}/generate", json=body,
                            headers={"X-Kvatlas-Explain": "1"}) as resp:
        assert resp.status == 200, await resp.text()
        return json.loads(resp.headers["X-Kvatlas-Route"])


async def received(session: aiohttp.ClientSession, url: str) -> float:
    """Other routers' predictions ``url``'s router took."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    line = 'kvatlas_router_shared_predictions_total{direction="received"} '
    return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))


async def test_a_conversation_sticks_to_its_holder_through_another_router(
        etcd_endpoint: str, own_cluster: list[SidecarCluster]) -> None:
    cluster = start_cluster(etcd_endpoint, routers=2, sidecar_extra=_no_events)
    own_cluster.append(cluster)
    lone = Router(cluster.etcd, cluster.prefix, "--no-share-predictions")
    cluster.extra.append(lone)
    lone.wait_http(f"{lone.url}/readiness", 60)
    a, b = cluster.router.url, cluster.extra[0].url
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    holders = set()
    async with aiohttp.ClientSession(timeout=timeout) as s:
        for i in range(6):
            turn1 = f"Conversation {i} opens with a question long enough for several blocks. " * 2
            first = await routed(s, a, turn1)
            holders.add(first["prefill"])
            assert first["prompt_blocks"] >= 8
            turn2 = turn1 + f"And turn two of conversation {i} follows."
            # Router b hears of turn one (typically milliseconds after routing; how fast is
            # for bench/, not a test).
            async def heard(i: int = i) -> bool:
                return await received(s, b) >= i + 1
            await wait_until(heard, what=f"router b hears of turn {i}",
                             detail=cluster.logs)
            # Router b never routed turn one, and the index shows nothing: it knows the holder
            # from router a's shared prediction alone.
            second = await routed(s, b, turn2)
            assert second["prefill"] == first["prefill"], (i, first, second)
            assert second["index_blocks"] == 0
            assert second["matched_blocks"] >= first["prompt_blocks"], (i, first, second)
            # A router that does not share knows nothing of it.
            alone = await routed(s, lone.url, turn2)
            assert alone["matched_blocks"] == 0, alone
    assert len(holders) == 2  # both prefills held conversations (not one by default)
