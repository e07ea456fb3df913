"""Aggregated kvatlas engines found through etcd: two real monolithic engines register as
aggregated instances, a router with --etcd discovers them, sends each request whole to one, and
once an engine's KV events reached the index routes a prompt sharing its prefix to that engine on
the index's word (index_blocks), not only on its own prediction."""
from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from pd_procs import Proc
from waiting import wait_until

from index.etcd import EtcdSettings
from router.app import create_app
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(150)


def _body(ids: list[int]) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                  "ignore_eos": True}}


async def test_discovered_aggregated_engines_are_routed_on_the_index(
        etcd_endpoint: str, key_prefix: str) -> None:
    engines = [Proc("monolithic", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
                    "--instance-id", f"agg-{i}") for i in range(2)]
    app = None
    try:
        for e in engines:
            e.wait_ready()
        # Predictions live briefly and are not shared: a later match must be the index's.
        cfg = RouterConfig(etcd=EtcdSettings(endpoints=[etcd_endpoint]), etcd_prefix=key_prefix,
                           model="tiny", tokenizers={None: "byte"}, explain_routes=True,
                           prediction_ttl=0.01, prediction_catch_up=0.0,
                           share_predictions=False, retry_initial_backoff=0.005)
        app = create_app(cfg)
        port = await app.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            async def both_ready() -> bool:
                async with s.get(url + "/readiness") as r:
                    doc = await r.json()
                return r.status == 200 and doc["aggregated"]["available"] == 2
            await wait_until(both_ready, what="the router discovered both aggregated engines",
                             timeout=30.0, interval=0.1)
            shared = [40 + i % 150 for i in range(16 * 8)]
            async with s.post(url + "/generate", json=_body(shared + [1, 2])) as r:
                assert r.status == 200, await r.text()
                first = json.loads(r.headers["x-kvatlas-route"])
                assert (await r.json())["output_ids"]
            holder = first["worker"]

            async def indexed() -> bool:
                async with s.post(url + "/debug/route", json=_body(shared + [3])) as r:
                    doc = await r.json()
                return doc["worker"]["instance_id"] == holder and doc["index_blocks"] >= 8
            await wait_until(indexed, what=f"the index shows {holder} holding the prefix",
                             timeout=30.0, interval=0.2)
            async with s.post(url + "/generate", json=_body(shared + [4, 5])) as r:
                assert r.status == 200, await r.text()
                again = json.loads(r.headers["x-kvatlas-route"])
            assert again["worker"] == holder and again["index_blocks"] >= 8, again
    finally:
        if app is not None:
            await app.close()
        for e in engines:
            e.stop()


async def test_a_pd_fleet_serves_short_prompts_on_a_decode_prefilling_locally(
        etcd_endpoint: str, key_prefix: str) -> None:
    """A real prefill and a real decode registered through etcd (the decode, started with
    --local-prefill, says local_prefill in its record) behind a router with --etcd: a short
    prompt is served whole by the decode (greedy tokens equal the monolithic engine's), a long
    one by the pair."""
    from pd_helpers import monolithic

    common = ["--etcd", etcd_endpoint, "--etcd-prefix", key_prefix]
    procs = [Proc("prefill", *common, "--instance-id", "p-0"),
             Proc("decode", *common, "--instance-id", "d-0", "--local-prefill")]
    app = None
    try:
        for p in procs:
            p.wait_ready()
        cfg = RouterConfig(etcd=EtcdSettings(endpoints=[etcd_endpoint]), etcd_prefix=key_prefix,
                           model="tiny", tokenizers={None: "byte"}, explain_routes=True,
                           disagg_tokens=128, retry_initial_backoff=0.005)
        app = create_app(cfg)
        port = await app.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        short = [256, *range(40, 40 + 3 * 16)]
        long = [256, *(40 + i % 150 for i in range(40 * 16))]
        want = monolithic([short, long], [4, 4])
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                async with s.get(url + "/readiness") as r:
                    return r.status == 200
            await wait_until(ready, what="the router found the pair", timeout=30.0,
                             interval=0.1)
            for ids, path, tokens in ((short, "aggregated", want[0]), (long, "pd", want[1])):
                async with s.post(url + "/generate", json=_body(ids)) as r:
                    assert r.status == 200, await r.text()
                    route = json.loads(r.headers["x-kvatlas-route"])
                    assert (await r.json())["output_ids"] == tokens, route
                assert route["disaggregation"]["path"] == path, route
                if path == "aggregated":
                    assert route["worker"] == "d-0", route
    finally:
        if app is not None:
            await app.close()
        for p in procs:
            p.stop()
