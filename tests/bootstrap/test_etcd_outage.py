"""etcd goes away and comes back: the server answers from memory, then the mirror is whole again."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from bootstrap_helpers import TOPOLOGY_QUERY, rank_body, route_query
from waiting import wait_until

from bootstrap.config import BootstrapConfig
from bootstrap.server import STATE, create_app
from index.errors import EtcdError
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, loads
from kvatlas.etcd_proc import EtcdCluster


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    """An etcd of this test alone, because the test stops and restarts it."""
    cluster = EtcdCluster(1).start()
    yield cluster
    cluster.stop()


async def _wait_mirror(etcd: EtcdClient, layout: KeyLayout, iid: str,
                       want: dict[tuple[int, int, int, int], int], timeout: float) -> None:
    """Wait until etcd holds exactly ``want`` (cell -> port) under a live lease, plus a ready
    instance record; fails after ``timeout``."""
    last: list[Any] = [None]

    async def mirrored() -> bool:
        try:
            inst = await etcd.get(layout.instance(iid))
            _, kvs = await etcd.get_prefix(layout.ranks_prefix(iid))
        except EtcdError as exc:
            last[0] = exc
            return False
        got = {layout.parse_rank(kv.key)[1]: loads(kv.value)["rank_port"] for kv in kvs}
        leases = {kv.lease for kv in kvs} | ({inst.lease} if inst else set())
        last[0] = got
        if inst is None or not loads(inst.value)["ready"] or got != want or len(leases) != 1:
            return False
        (lease,) = leases
        try:
            return bool(lease) and await etcd.lease_ttl(lease) > 0
        except EtcdError as exc:
            last[0] = exc
            return False

    await wait_until(mirrored, what=f"etcd mirrors {want} under one live lease",
                     timeout=timeout, interval=0.1, detail=lambda: last[0])


async def test_serves_from_memory_while_etcd_is_down_and_remirrors(
        aiohttp_client: Any, own_etcd: EtcdCluster) -> None:
    settings = EtcdSettings.from_text(own_etcd.endpoints, timeout=1.0)
    layout = KeyLayout()
    config = BootstrapConfig(instance_id="pf", model="m", etcd=settings, lease_ttl=2)
    client = await aiohttp_client(create_app(config))
    mirror = client.server.app[STATE].mirror
    want = {(0, 0, tp, 0): 21000 + tp for tp in range(4)}
    for (_, _, tp, _), port in want.items():
        assert (await client.put("/route", json=rank_body(tp=tp, tp_size=4, port=port))).status == 200
    etcd = EtcdClient(settings)
    try:
        await _wait_mirror(etcd, layout, "pf", want, timeout=60)

        member = own_etcd.members[0]
        await asyncio.to_thread(member.stop)
        # From memory: topology and every cell, while the mirror notices the outage.
        async def served_from_memory_until_degraded() -> bool:
            assert (await client.get("/route", params=TOPOLOGY_QUERY)).status == 200
            for (dp, cp, tp, pp), port in want.items():
                resp = await client.get("/route", params=route_query(dp, cp, tp, pp))
                assert resp.status == 200 and (await resp.json())["rank_port"] == port
            return mirror.state == "degraded"
        await wait_until(served_from_memory_until_degraded, what="the mirror is degraded",
                         interval=0.1, detail=lambda: mirror.state)
        # A rank restarts during the outage: memory takes it at once.
        want[(0, 0, 2, 0)] = 29002
        assert (await client.put("/route", json=rank_body(tp=2, tp_size=4, port=29002))).status == 200
        resp = await client.get("/route", params=route_query(0, 0, 2, 0))
        assert (await resp.json())["rank_port"] == 29002
        metrics = await (await client.get("/metrics")).text()
        assert 'kvatlas_bootstrap_mirror_state{state="degraded"} 1.0' in metrics
        # On purpose, not a wait: the outage outlasts the lease TTL, so the lease is lost.
        await asyncio.sleep(2.5)

        await asyncio.to_thread(member.start)
        await asyncio.to_thread(member.wait_ready)
        # No re-registration: the server rewrites its keys by itself.
        await _wait_mirror(etcd, layout, "pf", want, timeout=60)

        # The lease lost while etcd was away (here: revoked behind the server's back) costs the
        # keys only until the next keepalive, after which a new lease carries all of them again.
        kv = await etcd.get(layout.instance("pf"))
        assert kv is not None
        await etcd.revoke(kv.lease)
        assert await etcd.get(layout.instance("pf")) is None
        await _wait_mirror(etcd, layout, "pf", want, timeout=config.lease_ttl + 20)
        new = await etcd.get(layout.instance("pf"))
        assert new is not None and new.lease != kv.lease
    finally:
        await etcd.close()


async def test_etcd_unreachable_at_start_then_mirrored_when_it_comes(aiohttp_client: Any) -> None:
    cluster = EtcdCluster(1)  # ports chosen, not started yet
    try:
        settings = EtcdSettings.from_text(cluster.endpoints, timeout=1.0)
        config = BootstrapConfig(instance_id="early", model="m", etcd=settings, lease_ttl=2)
        client = await aiohttp_client(create_app(config))
        want = {(0, 0, tp, 0): 22000 + tp for tp in range(2)}
        for (_, _, tp, _), port in want.items():
            resp = await client.put("/route", json=rank_body(tp=tp, tp_size=2, port=port))
            assert resp.status == 200
        assert (await client.get("/route", params=TOPOLOGY_QUERY)).status == 200
        table = await (await client.get("/table")).json()
        assert table["ready"] is True and table["mirror"]["state"] != "synced"
        mirror = client.server.app[STATE].mirror
        await wait_until(lambda: mirror.state == "degraded",  # not stuck at "connecting"
                         what="the mirror is degraded", detail=lambda: mirror.state)
        # The first change is still waiting: its lag grows (and is not reset by the retries).
        await wait_until(lambda: mirror.lag >= 1.0, what="the mirror's lag reaches 1 s",
                         detail=lambda: (mirror.state, mirror.lag))

        await asyncio.to_thread(cluster.start)
        etcd = EtcdClient(settings)
        try:
            # a deadline far past the etcd client's reconnect back-off on a loaded box
            await _wait_mirror(etcd, KeyLayout(), "early", want, timeout=60)
        finally:
            await etcd.close()
        assert await client.server.app[STATE].mirror.wait_synced(5)
    finally:
        cluster.stop()
