"""The mirror into a real etcd, with the server in-process: 512 concurrent ranks, latency, stale keys."""
from __future__ import annotations

import asyncio
import random
from typing import Any

from bootstrap_helpers import TOPOLOGY_QUERY, rank_body, route_query

from bootstrap.config import BootstrapConfig
from bootstrap.server import STATE, create_app
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, loads

SIZES = {"dp_size": 4, "cp_size": 4, "tp_size": 16, "pp_size": 2}  # 512 cells


def _cells() -> list[tuple[int, int, int, int]]:
    return [(dp, cp, tp, pp) for dp in range(4) for cp in range(4) for tp in range(16)
            for pp in range(2)]


def _body(cell: tuple[int, int, int, int], port_base: int = 20000) -> dict[str, Any]:
    dp, cp, tp, pp = cell
    port = port_base + ((dp * 4 + cp) * 16 + tp) * 2 + pp
    return rank_body(dp=dp, cp=cp, tp=tp, pp=pp, ip=f"10.1.{dp}.{cp * 32 + tp}", port=port,
                     **SIZES)


async def _mirrored(etcd: EtcdClient, layout: KeyLayout, iid: str) -> tuple[dict, dict]:
    inst = await etcd.get(layout.instance(iid))
    _, kvs = await etcd.get_prefix(layout.ranks_prefix(iid))
    ranks = {layout.parse_rank(kv.key)[1]: loads(kv.value) for kv in kvs}
    return (loads(inst.value) if inst else {}), ranks


async def test_512_ranks_concurrently_ready_exactly_at_the_last(
        aiohttp_client: Any, etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    config = BootstrapConfig(instance_id="big", model="org/model", etcd=etcd_settings,
                             etcd_prefix=key_prefix)
    client = await aiohttp_client(create_app(config))
    cells = _cells()
    random.Random(7).shuffle(cells)
    last, first_511 = cells[-1], cells[:-1]
    # Re-registrations of cells already sent (a restarted rank, a retry) must not count.
    dupes = [_body(c, port_base=40000) for c in first_511[:150]] + [_body(c) for c in first_511[150:300]]
    bodies = [_body(c) for c in first_511] + dupes
    random.Random(8).shuffle(bodies)
    results = await asyncio.gather(*(client.put("/route", json=b) for b in bodies))
    assert [r.status for r in results] == [200] * len(bodies)
    resp = await client.get("/ready")
    assert (resp.status, await resp.text()) == (503, "511 of 512 ranks registered")
    assert (await client.get("/route", params=TOPOLOGY_QUERY)).status == 503

    assert (await client.put("/route", json=_body(last))).status == 200
    resp = await client.get("/ready")
    assert (resp.status, await resp.text()) == (200, "512 of 512 ranks registered")
    doc = await (await client.get("/route", params=TOPOLOGY_QUERY)).json()
    assert (doc["dp_size"], doc["attn_cp_size"], doc["attn_tp_size"], doc["pp_size"]) == (4, 4, 16, 2)

    # The table is complete. 150 cells got a second PUT with another port, in random order
    # with the first: either address is right for them, and nothing else is.
    latest = {c: _body(c) for c in _cells()}
    table = await (await client.get("/table")).json()
    assert len(table["ranks"]) == 512
    for r in table["ranks"]:
        cell = (r["dp"], r["cp"], r["tp"], r["pp"])
        allowed = {latest[cell]["rank_port"], _body(cell, port_base=40000)["rank_port"]}
        assert r["rank_port"] in allowed and r["rank_ip"] == latest[cell]["rank_ip"]
    for cell in random.Random(9).sample(_cells(), 20):
        got = await (await client.get("/route", params=route_query(*cell))).json()
        assert got["rank_ip"] == latest[cell]["rank_ip"]

    # And the whole table reaches etcd.
    state = client.server.app[STATE]
    assert await state.mirror.wait_synced(10)  # type: ignore[union-attr]
    inst, ranks = await _mirrored(etcd, layout, "big")
    assert len(ranks) == 512
    assert inst["ready"] is True and inst["registered_ranks"] == 512 and inst["expected_ranks"] == 512
    assert inst["role"] == "prefill" and inst["model"] == "org/model"
    assert inst["topology"]["attn_tp_size"] == 16
    for r in table["ranks"]:
        cell = (r["dp"], r["cp"], r["tp"], r["pp"])
        assert (ranks[cell]["rank_ip"], ranks[cell]["rank_port"]) == (r["rank_ip"], r["rank_port"])


async def test_mirror_reaches_etcd_within_one_second_and_drops_stale_keys(
        aiohttp_client: Any, etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    # Left over by an earlier run of the same instance id; and a neighbour sharing the id prefix.
    stale = layout.rank("p1", 3, 0, 0, 0)
    await etcd.put(stale, b'{"rank_ip":"10.9.9.9","rank_port":1}')
    neighbour = layout.instance("p10")
    await etcd.put(neighbour, b'{"instance_id":"p10"}')
    config = BootstrapConfig(instance_id="p1", model="m", port=18998, etcd=etcd_settings,
                             etcd_prefix=key_prefix, lease_ttl=5,
                             instance_fields={"url": "http://127.0.0.1:30000", "role": "ignored"})
    client = await aiohttp_client(create_app(config))
    mirror = client.server.app[STATE].mirror
    assert await mirror.wait_synced(10)
    assert await etcd.get(stale) is None
    assert await etcd.get(neighbour) is not None
    inst, _ = await _mirrored(etcd, layout, "p1")
    assert inst["url"] == "http://127.0.0.1:30000" and inst["role"] == "prefill"
    assert inst["bootstrap_host"] == "127.0.0.1" and inst["bootstrap_port"] == 18998
    assert inst["registered_ranks"] == 0 and inst["expected_ranks"] is None

    for tp in range(4):
        body = rank_body(tp=tp, tp_size=4, port=31000 + tp)
        assert (await client.put("/route", json=body)).status == 200
        # the PUT marked the mirror unsynced before it answered: synced now means written
        assert await mirror.wait_synced(60), f"rank tp={tp} never mirrored"
        kv = await etcd.get(layout.rank("p1", 0, 0, tp, 0))
        assert kv is not None, f"the mirror says synced without rank tp={tp} in etcd"
        assert loads(kv.value)["rank_port"] == 31000 + tp
        assert kv.lease != 0  # under the instance lease
    assert await mirror.wait_synced(5)
    inst, ranks = await _mirrored(etcd, layout, "p1")
    assert inst["ready"] is True and len(ranks) == 4
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_bootstrap_mirror_state{state="synced"} 1.0' in metrics
