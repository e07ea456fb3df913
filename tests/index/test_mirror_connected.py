"""``BlockMirror.connected``: True while etcd answers; False once quorum is lost (a leaderless
member keeps the watch open and even answers progress requests, so only a quorum read tells),
with the last known blocks still served; True again after the members return."""
from __future__ import annotations

import asyncio

import pytest
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode
from kvatlas.etcd_proc import EtcdCluster

pytestmark = pytest.mark.timeout(90)
MODEL = "org/model-c"
CONFIG = BlockMirrorConfig(progress_every=0.2, stale_after=1.5)


async def test_quorum_loss_clears_connected_and_recovery_sets_it(
        etcd_cluster3: EtcdCluster) -> None:
    layout = KeyLayout(prefix="/conn-test")
    key = layout.segment(MODEL, "inst-a", 0xab)
    async with EtcdClient(EtcdSettings.from_text(etcd_cluster3.endpoints, timeout=2.0)) as client:
        await client.put(key, encode(0.0, None, [0xab], ["GPU"]))
        mirror = BlockMirror(client, layout, MODEL, CONFIG)
        assert not mirror.connected, "not connected before the first load"
        mirror.start()
        try:
            assert await mirror.wait_ready(10)
            await wait_until(lambda: mirror.connected, what="the mirror is connected after the load",
                             detail=mirror.stats)
            # A window where something must NOT happen: while etcd is healthy, progress responses
            # and probes keep it connected for two stale_after periods.
            loop = asyncio.get_running_loop()
            quiet_until = loop.time() + CONFIG.stale_after * 2
            while loop.time() < quiet_until:
                assert mirror.connected, f"disconnected with etcd healthy: {mirror.stats()}"
                await asyncio.sleep(0.05)
            assert mirror.blocks("inst-a") == {0xab}

            for member in etcd_cluster3.members[1:]:
                member.kill()
            await wait_until(lambda: not mirror.connected,
                             what="the mirror reads disconnected after quorum loss",
                             detail=mirror.stats)
            assert mirror.stats()["connected"] is False
            assert mirror.blocks("inst-a") == {0xab}, "the last known index is still served"

            for member in etcd_cluster3.members[1:]:
                member.start()
            await wait_until(lambda: mirror.connected,
                             what="the mirror is connected again after the members return",
                             detail=mirror.stats)
            rev = await client.put(layout.segment(MODEL, "inst-a", 0xcd),
                                   encode(0.0, None, [0xcd], ["GPU"]))
            assert await mirror.wait_revision(rev, 10)
            assert mirror.blocks("inst-a") == {0xab, 0xcd}
        finally:
            await mirror.close()


def test_stale_after_must_exceed_progress_every() -> None:
    with pytest.raises(ValueError, match="stale_after"):
        BlockMirrorConfig(progress_every=1.0, stale_after=1.0)
