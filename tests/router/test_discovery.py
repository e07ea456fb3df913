"""Pools follow etcd instance keys by watch (real etcd, real leases, real stub workers)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from waiting import wait_until

from index.errors import EtcdUnavailable
from index.etcd import EtcdClient, EtcdSettings, KeyValue, WatchBatch
from index.keys import KeyLayout, dumps
from router.config import RouterConfig


async def router(start_router: Any, etcd_settings: Any, key_prefix: str,
                 **kw: Any) -> Any:
    cfg = RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix, health_interval=60, **kw)
    return await start_router(cfg)


def ids(workers: dict[str, list[dict[str, Any]]], role: str) -> set[str]:
    return {w["instance_id"] for w in workers[role] if w["ready"]}


async def test_join_and_leave_follow_the_instance_keys(start_router: Any, etcd: Any, layout: Any,
                                              etcd_settings: Any, key_prefix: str,
                                              stubs: Any, register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await router(start_router, etcd_settings, key_prefix, model="tiny")
    assert (await client.get("/readiness")).status == 503

    async def listed(role: str, iid: str, present: bool = True) -> bool:
        workers = await (await client.get("/workers")).json()
        return (iid in ids(workers, role)) == present

    pi = await register("p0", {"role": "prefill", "url": p.url, "model": "tiny",
                               "bootstrap_host": "10.1.2.3", "bootstrap_port": 8998,
                               "ready": True})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    await wait_until(lambda: listed("prefill", "p0"), what="p0 is listed as a ready prefill")
    await wait_until(lambda: listed("decode", "d0"), what="d0 is listed as a ready decode")
    assert (await client.get("/readiness")).status == 200
    resp = await client.post("/generate", json={"text": "hello"})
    assert resp.status == 200
    assert p.bodies[0]["bootstrap_host"] == "10.1.2.3" and p.bodies[0]["bootstrap_port"] == 8998

    # Not ready (ranks still registering): listed but never chosen.
    await pi.update(ready=False)
    await wait_until(lambda: listed("prefill", "p0", present=False),
                     what="p0, no longer ready, is not listed as ready")
    resp = await client.post("/generate", json={"text": "hello"})
    assert resp.status == 503 and "not ready" in (await resp.json())["error"]
    await pi.update(ready=True)
    await wait_until(lambda: listed("prefill", "p0"), what="p0 is ready again")

    await pi.stop(revoke=True)  # the instance dies: its lease and keys go
    await wait_until(lambda: listed("prefill", "p0", present=False),
                     what="p0 leaves the list once its lease is revoked")
    ready = await client.get("/readiness")
    assert ready.status == 503 and "no prefill" in (await ready.json())["prefill"]["reason"]


async def test_a_worker_that_moves_is_reached_at_its_new_url_only(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    (p_old, p_new), (d,) = await stubs("prefill", 2), await stubs("decode")
    client = await router(start_router, etcd_settings, key_prefix, model="tiny")
    pi = await register("p0", {"role": "prefill", "url": p_old.url, "model": "tiny"})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})

    async def ready() -> bool:
        return (await client.get("/readiness")).status == 200

    await wait_until(ready, what="the router is ready")
    assert (await client.post("/generate", json={"text": "one"})).status == 200
    pools = client.app.upstreams.pools
    assert p_old.url in pools
    old_pool = pools[p_old.url]

    # Restarted on another port: same instance id, new URL.
    await pi.update(url=p_new.url)

    async def moved() -> bool:
        return p_old.url not in pools

    await wait_until(moved, what="the pool at the old URL is gone")
    assert old_pool.closed
    assert (await client.post("/generate", json={"text": "two"})).status == 200
    assert len(p_old.bodies) == 1 and len(p_new.bodies) == 1


async def test_records_ignored_when_unusable(start_router: Any, etcd: Any, layout: Any,
                                             etcd_settings: Any, key_prefix: str,
                                             stubs: Any, register: Any) -> None:
    (p,) = await stubs("prefill")
    # Records present before the router starts are picked up by the initial get.
    await etcd.put(layout.instance("nourl"), b'{"role": "prefill", "model": "tiny"}')
    await etcd.put(layout.instance("garbage"), b"not json")
    await etcd.put(layout.instance("deep"), b"[" * 5000 + b"]" * 5000)  # RecursionError
    await etcd.put(layout.instance("other"), ('{"role": "prefill", "model": "big", "url": "%s"}'
                                              % p.url).encode())
    await etcd.put(layout.instance("good"), ('{"role": "prefill", "model": "tiny", "url": "%s"}'
                                             % p.url).encode())
    client = await router(start_router, etcd_settings, key_prefix, model="tiny")

    async def workers() -> dict[str, list[dict[str, Any]]]:
        return await (await client.get("/workers")).json()

    async def only_good() -> bool:
        return ids(await workers(), "prefill") == {"good"}

    await wait_until(only_good, what="only the usable record is a prefill worker",
                     detail=lambda: client.app.state.discovery.stats())
    listed = (await workers())["prefill"]
    assert [(w["instance_id"], w["url"]) for w in listed] == [("good", p.url)]
    # A record rewritten without its url leaves the pool.
    await etcd.put(layout.instance("good"), b'{"role": "prefill", "model": "tiny"}')

    async def empty() -> bool:
        return not (await workers())["prefill"]

    await wait_until(empty, what="the record without a url leaves the prefill pool")
    assert (await workers())["prefill"] == []


async def test_etcd_record_shadows_static_worker_with_same_url(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await router(start_router, etcd_settings, key_prefix, prefill=[(p.url, None)],
                          decode=[d.url])
    inst = await register("p-real", {"role": "prefill", "url": p.url, "bootstrap_port": 9000})

    async def shadowed() -> bool:
        workers = await (await client.get("/workers")).json()
        return ids(workers, "prefill") >= {"p-real"}

    await wait_until(shadowed, what="the etcd record p-real is a prefill worker")
    # One URL, one candidate: the etcd id (the one the block index uses) is chosen.
    body = await (await client.post("/debug/route", json={"text": "x" * 64})).json()
    assert [c["instance_id"] for c in body["candidates"]] == ["p-real"]
    assert body["prefill"]["bootstrap_port"] == 9000
    await inst.stop()

    async def static_back() -> bool:
        body = await (await client.post("/debug/route", json={"text": "x" * 64})).json()
        return body.get("prefill", {}).get("instance_id", "").startswith("static-")

    await wait_until(static_back, what="the static worker is chosen again once p-real is gone")


async def test_static_workers_serve_while_etcd_is_unreachable(start_router: Any,
                                                              stubs: Any) -> None:
    from index.etcd import EtcdSettings
    from kvatlas.etcd_proc import free_port
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    dead = EtcdSettings.from_text(f"127.0.0.1:{free_port()}", timeout=0.5)
    client = await start_router(RouterConfig(
        etcd=dead, prefill=[(p.url, None)], decode=[d.url], health_interval=60))
    resp = await client.post("/generate", json={"text": "still routing"})
    assert resp.status == 200
    ready = await client.get("/readiness")
    assert ready.status == 200
    detail = await ready.json()
    assert detail["index"]["state"] in ("starting", "loading", "stale")
    metrics = await (await client.get("/metrics")).text()
    assert "kvatlas_router_index_ready 0.0" in metrics


async def test_quorum_loss_degrades_discovery_and_keeps_pools(etcd_cluster3: Any) -> None:
    """A leaderless member keeps the watch open (and answers progress requests): the quorum
    probe turns discovery "degraded" within seconds; pools stay as last known; it syncs back."""
    from index.etcd import EtcdClient, EtcdSettings
    from index.keys import KeyLayout, dumps
    from router.discovery import InstanceDiscovery
    from router.workers import PREFILL, WorkerPools

    layout = KeyLayout(prefix="/disc-quorum")
    settings = EtcdSettings.from_text(etcd_cluster3.endpoints, timeout=2.0)
    async with EtcdClient(settings) as client:
        await client.put(layout.instance("p0"), dumps({
            "role": "prefill", "url": "http://127.0.0.1:9", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 8998, "model": "tiny"}))
        pools = WorkerPools(RouterConfig())
        disc = InstanceDiscovery(client, layout, pools, "tiny", progress_every=0.2,
                                 stale_after=1.5)
        task = asyncio.create_task(disc.run())

        try:
            assert await disc.wait_synced(10)
            # A window where something must NOT happen: with etcd healthy, progress notifications
            # and probes keep it "synced" for several stale_after periods.
            quiet_until = asyncio.get_running_loop().time() + 3.0
            while asyncio.get_running_loop().time() < quiet_until:
                assert disc.state == "synced", f"left synced with etcd healthy: {disc.stats()}"
                await asyncio.sleep(0.05)
            assert pools.get(PREFILL, "p0") is not None
            for member in etcd_cluster3.members[1:]:
                member.kill()
            await wait_until(lambda: disc.state == "degraded",
                             what="discovery reads degraded after losing quorum", detail=disc.stats)
            assert pools.get(PREFILL, "p0") is not None, "pools kept as last known"
            for member in etcd_cluster3.members[1:]:
                member.start()
            await wait_until(lambda: disc.state == "synced",
                             what="discovery syncs back once quorum returns", detail=disc.stats)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class FlappingWatchClient(EtcdClient):
    """A real client whose watches, while ``flapping``, pass on etcd's "created" response and
    break at the next one: a stream that opens and never delivers. Counts prefix snapshots."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.flapping = False
        self.snapshots = 0

    async def get_prefix(self, prefix: bytes,
                         keys_only: bool = False) -> tuple[int, list[KeyValue]]:
        self.snapshots += 1
        return await super().get_prefix(prefix, keys_only)

    async def watch_prefix(self, prefix: bytes, start_revision: int,  # type: ignore[override]
                           progress_every: float | None = None,
                           fragment: bool = False) -> AsyncIterator[WatchBatch]:
        inner = super().watch_prefix(prefix, start_revision, progress_every, fragment)
        async with contextlib.aclosing(inner):
            async for batch in inner:
                if self.flapping and not batch.created:
                    raise EtcdUnavailable("watch stream reset (test)")
                yield batch


async def test_a_watch_that_only_opens_reads_degraded_and_is_no_reload_storm(
        etcd: EtcdClient, etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    """etcd's "created" promises a stream, not that it delivers: a watch that keeps opening and
    breaking must read "degraded" (pools as last known) until it delivers again, and each break
    is a resume, not a snapshot of the whole prefix with the backoff started over."""
    from router.discovery import InstanceDiscovery
    from router.workers import PREFILL, WorkerPools

    def record(port: int) -> bytes:
        return dumps({"role": "prefill", "url": f"http://127.0.0.1:{port}",
                      "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "model": "tiny"})

    await etcd.put(layout.instance("p0"), record(9))
    client = FlappingWatchClient(etcd_settings)
    await client.connect()
    pools = WorkerPools(RouterConfig())
    disc = InstanceDiscovery(client, layout, pools, "tiny", progress_every=0.1, stale_after=1.0)
    task = asyncio.create_task(disc.run())
    loop = asyncio.get_running_loop()
    try:
        assert await disc.wait_synced(10)
        await wait_until(lambda: disc.state == "synced", what="discovery reads synced",
                         detail=disc.stats)
        client.flapping = True
        snapshots = client.snapshots
        await etcd.put(layout.instance("p1"), record(10))
        degraded = False
        # An observation window, not a wait: across it no break may read "synced" again.
        until = loop.time() + 2.5
        while loop.time() < until:
            state = disc.state
            degraded = degraded or state == "degraded"
            # Once the break was noticed, only a delivery may make it read "synced" again.
            assert not (degraded and state == "synced"), (
                f"synced behind a watch that only opens: {disc.stats()}")
            await asyncio.sleep(0.01)
        assert degraded, f"the breaks were noticed: {disc.stats()}"
        assert client.snapshots - snapshots <= 1, (
            f"{client.snapshots - snapshots} snapshots of the prefix in 2.5 s: {disc.stats()}")
        assert pools.get(PREFILL, "p0") is not None, "pools kept as last known"

        client.flapping = False  # the stream delivers again: it resumes and catches up
        await wait_until(lambda: disc.state == "synced" and pools.get(PREFILL, "p1") is not None,
                         what="discovery resumed, synced and caught up with p1",
                         detail=disc.stats)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()


async def test_malformed_and_newer_records_are_skipped_and_counted(
        start_router: Any, etcd: Any, layout: Any, etcd_settings: Any, key_prefix: str,
        stubs: Any) -> None:
    (p,) = await stubs("prefill")
    url = p.url
    await etcd.put(layout.instance("typo"), dumps({"role": "prefill", "url": url,
                                                   "bootstrap_port": "8998"}))
    await etcd.put(layout.instance("future"), dumps({"v": 2, "role": "prefill", "url": url}))
    await etcd.put(layout.instance("good"), dumps({"v": 1, "role": "prefill", "url": url,
                                                   "model": "tiny"}))
    client = await router(start_router, etcd_settings, key_prefix, model="tiny")

    async def only_good() -> bool:
        workers = await (await client.get("/workers")).json()
        return ids(workers, "prefill") == {"good"}

    await wait_until(only_good, what="only the good record is a prefill worker")
    discovery = client.app.state.discovery
    assert discovery.stats()["records_refused"] == {"malformed": 1, "newer_version": 1}
    # Rewritten (a watch event each): counted again, the good one still used.
    await etcd.put(layout.instance("future"), dumps({"v": 3, "role": "prefill", "url": url}))

    async def counted() -> bool:
        return discovery.stats()["records_refused"]["newer_version"] == 2

    await wait_until(counted, what="the rewritten newer record is counted again",
                     detail=discovery.stats)
    assert await only_good()
