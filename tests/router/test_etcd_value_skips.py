"""Every watcher of etcd skips a key or value it cannot read, counts it and goes on (real etcd).

A non-UTF-8 instance key once made discovery (and the decode's prefill-restart watch) reload in
a loop, so that a dead instance's deletion was never applied; arbitrary bytes as a key or value
under any watched prefix must never stop a watcher (hypothesis), and the router's Prometheus
metrics count the skips by prefix kind and reason."""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from etcd_instances import Instance
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from waiting import wait_until

from engine.pd.restarts import PrefillRestarts
from index.etcd import Delete, EtcdClient, EtcdSettings, Put
from index.follow import PrefixFollower, skipped_totals
from index.keys import KeyLayout, dumps
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.metrics import RouterMetrics
from router.shared_predictions import PeerPredictions
from router.shared_predictions import encode as encode_predictions
from router.workers import PREFILL, WorkerPools

pytestmark = pytest.mark.timeout(240)


def _record(iid: str, port: int = 9) -> dict[str, Any]:
    return {"role": "prefill", "url": f"http://127.0.0.1:{port}", "bootstrap_host": "127.0.0.1",
            "bootstrap_port": port, "model": "tiny", "started_at": 1.0, "instance_id": iid}


async def test_a_non_utf8_instance_key_does_not_stop_a_deletion(
        etcd: EtcdClient, layout: KeyLayout) -> None:
    bad_key = layout.instances_prefix() + b"\xff\xfe-not-utf8"
    await etcd.put(bad_key, dumps(_record("x")))  # there from the start: the snapshot skips it
    dead = await Instance(etcd, layout, "p-dead", _record("p-dead")).start()
    kept = await Instance(etcd, layout, "p-kept", _record("p-kept", 10)).start()
    pools = WorkerPools(RouterConfig())
    disc = InstanceDiscovery(etcd, layout, pools, "tiny", progress_every=0.1, stale_after=1.0)
    restarts = PrefillRestarts(etcd, layout, _no_change, progress_every=0.1)
    before = skipped_totals().get(("instances", "bad_key"), 0)
    disc.start()
    restarts.start()
    try:
        assert await disc.wait_synced(10) and await restarts.wait_ready(10)
        assert {w.instance_id for w in pools.pool(PREFILL)} == {"p-dead", "p-kept"}
        await etcd.put(bad_key, b"\x80 not even JSON")  # a watch event under the bad key
        await dead.stop(revoke=True)  # the instance dies: its key's delete must apply
        await wait_until(lambda: pools.get(PREFILL, "p-dead") is None,
                         what="discovery to apply the dead instance's deletion",
                         detail=disc.stats)
        assert pools.get(PREFILL, "p-kept") is not None
        # The restart watch is a follower of its own: it reaches the same events in its own
        # time (CI once found it a revision behind discovery here).
        for follower in (disc, restarts):
            await wait_until(lambda f=follower: f.skipped == {"bad_key": 2},
                             what=f"{type(follower).__name__} to skip both writes under the "
                                  "bad key", detail=follower.follow_stats)
            assert follower.errors == 0 and follower.reloads == 1
        assert disc.state == "synced"
        assert skipped_totals()[("instances", "bad_key")] == before + 4
        # The router's metrics carry the count, by prefix kind and reason.
        text = RouterMetrics().render().decode()
        line = next(x for x in text.splitlines() if x.startswith(
            'kvatlas_router_etcd_values_skipped_total{prefix_kind="instances",reason="bad_key"}'))
        assert float(line.split()[-1]) >= 4
    finally:
        await disc.close()
        await restarts.close()
        await kept.stop()


async def _no_change(addr: str, reason: str) -> None:
    return None


# --- every watcher against arbitrary bytes ----------------------------------------------------

PREFIXES = ("instances", "blocks", "predictions")
junk = st.lists(st.tuples(st.sampled_from(PREFIXES), st.binary(max_size=24),
                          st.binary(max_size=48), st.booleans()), min_size=1, max_size=6)


class Watchers:
    """One of each watcher on one prefix, started once for every hypothesis example."""

    def __init__(self, client: EtcdClient, layout: KeyLayout) -> None:
        self.client, self.layout = client, layout
        self.pools = WorkerPools(RouterConfig())
        self.peer: list[tuple[str, str | None, tuple[int, ...]]] = []
        self.followers: list[PrefixFollower] = [
            BlockMirror(client, layout, None, BlockMirrorConfig(progress_every=0.1)),
            InstanceDiscovery(client, layout, self.pools, None, progress_every=0.1),
            PrefillRestarts(client, layout, _no_change, progress_every=0.1),
            PeerPredictions(client, layout, "me", lambda i, m, h: self.peer.append((i, m, h)),
                            60.0)]
        self.mirror = self.followers[0]

    def prefix(self, kind: str) -> bytes:
        return {"instances": self.layout.instances_prefix(),
                "blocks": self.layout.blocks_prefix(),
                "predictions": self.layout.predictions_prefix()}[kind]

    async def example(self, items: list[tuple[str, bytes, bytes, bool]], n: int) -> None:
        ops: list[Put | Delete] = []
        for kind, tail, value, delete in items:
            key = self.prefix(kind) + tail
            ops.append(Delete(key) if delete else Put(key, value))
        for op in ops:  # one by one: a txn refuses two ops on one key
            await self.client.txn([op])
        # Then one good change per watcher, and the deletion of the previous example's.
        good = f"i{n}"
        lay = self.layout
        rev = await self.client.txn([
            Put(lay.instance(good), dumps(_record(good))),
            Put(lay.segment("m", good, 1), encode(1.0, None, [n + 1], ["GPU"])),
            Put(lay.prediction("peer", n % 64), encode_predictions(9e9, [(good, "m", (n,))])),
            *([Delete(lay.instance(f"i{n - 1}")), Delete(lay.segment("m", f"i{n - 1}", 1))]
              if n else [])])
        for f in self.followers:
            assert await f.wait_revision(rev, 20), f"{f.name} never applied revision {rev}"
            assert f.errors == 0 and f._task is not None and not f._task.done(), f.follow_stats()
        assert self.mirror.blocks(good, "m") == {n + 1}  # type: ignore[attr-defined]
        assert self.pools.get(PREFILL, good) is not None
        assert (good, "m", (n,)) in self.peer
        if n:
            assert self.pools.get(PREFILL, f"i{n - 1}") is None
            assert not self.mirror.blocks(f"i{n - 1}", "m")  # type: ignore[attr-defined]


def test_arbitrary_keys_and_values_never_stop_a_watcher(etcd_endpoint: str) -> None:
    loop = asyncio.new_event_loop()
    client = EtcdClient(EtcdSettings.from_text(etcd_endpoint, timeout=3.0))
    layout = KeyLayout(f"/kvatlas-junk-{uuid.uuid4().hex[:12]}")
    w = Watchers(client, layout)
    count = [0]

    def run(coro):  # type: ignore[no-untyped-def]
        return loop.run_until_complete(asyncio.wait_for(coro, 60))

    async def start() -> None:
        await client.connect()
        for f in w.followers:
            f.start()
            assert await f.wait_ready(10)

    async def stop() -> None:
        for f in w.followers:
            await f.close()
        await client.delete(layout.prefix.encode() + b"/", prefix=True)
        await client.close()

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(junk)
    def example(items: list[tuple[str, bytes, bytes, bool]]) -> None:
        run(w.example(items, count[0]))
        count[0] += 1

    run(start())
    try:
        example()
        assert all(f.reloads == 1 for f in w.followers), [f.follow_stats() for f in w.followers]
        assert count[0] >= 10 and sum(sum(f.skipped.values()) for f in w.followers) > 0
    finally:
        run(stop())
        loop.close()
