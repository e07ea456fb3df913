"""The mirror after a very large change: 100k blocks written by a real writer (many transactions),
then removed in one revision (the writer's range delete, and a lease revoke as at an agent's
exit), each followed by ordinary traffic. The mirror must catch up within 5 s (the issue's
acceptance bound, a wait with a deadline) and must not read ``connected`` while it is behind a
watch that does not deliver."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from agent_helpers import eventually
from etcd_fakes import HeldWatchClient

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.lease import LeaseSession, cancel_and_wait
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode
from index.writer import BlockWriter

pytestmark = pytest.mark.timeout(240)
MODEL = "org/model-big"
N = 100_000
CATCH_UP = 5.0
"""Seconds from the first ordinary write after the big change until the mirror has applied it."""


@contextlib.asynccontextmanager
async def reader(settings: EtcdSettings, layout: KeyLayout,
                 config: BlockMirrorConfig | None = None,
                 client: EtcdClient | None = None) -> AsyncIterator[BlockMirror]:
    """A started mirror on a client of its own (a router's), with its defaults unless told."""
    own = client or EtcdClient(settings)
    await own.connect()
    mirror = BlockMirror(own, layout, MODEL, config)
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        yield mirror
    finally:
        await mirror.close()
        await own.close()


async def ordinary_write(etcd: EtcdClient, layout: KeyLayout, h: int) -> int:
    return await etcd.put(layout.segment(MODEL, "small", h), encode(1.0, None, [h], ["GPU"]))


async def assert_catches_up(mirror: BlockMirror, etcd: EtcdClient, layout: KeyLayout, h: int,
                            what: str) -> None:
    rev = await ordinary_write(etcd, layout, h)
    assert await mirror.wait_revision(rev, CATCH_UP), (
        f"mirror not caught up {CATCH_UP:g} s after {what}: {mirror.stats()}")
    assert h in mirror.blocks("small")


async def test_mirror_catches_up_after_100k_blocks_and_their_removal(
        etcd: EtcdClient, etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    session = LeaseSession(etcd, ttl=60)
    lease_task = asyncio.create_task(session.run())
    writer = BlockWriter(session, layout, MODEL, "big")
    writer.start()
    try:
        async with reader(etcd_settings, layout) as mirror:
            hashes = list(range(1, N + 1))
            writer.add(None, hashes)
            assert await writer.wait_synced(120), writer.stats()
            await assert_catches_up(mirror, etcd, layout, 1, "100k blocks in many transactions")
            assert len(mirror.blocks("big")) == N

            writer.clear()  # one range delete: 100k deletes in one revision
            assert await writer.wait_synced(60), writer.stats()
            await assert_catches_up(mirror, etcd, layout, 2, "a range delete of 100k blocks")
            assert mirror.blocks("big") == set()

            writer.add(None, hashes)
            assert await writer.wait_synced(120), writer.stats()
            await assert_catches_up(mirror, etcd, layout, 3, "100k blocks written again")
            assert len(mirror.blocks("big")) == N
            await writer.close()
            await session.revoke()  # the agent's exit: 100k deletes in one revision
            await assert_catches_up(mirror, etcd, layout, 4, "a lease revoke of 100k blocks")
            assert mirror.instances() == {"small"}
            assert mirror.errors == 0
    finally:
        await writer.close()
        await cancel_and_wait(lease_task)


async def test_connected_is_false_while_behind_a_stalled_watch(
        etcd: EtcdClient, etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    config = BlockMirrorConfig(progress_every=0.1, stale_after=0.5)
    client = HeldWatchClient(etcd_settings)
    async with reader(etcd_settings, layout, config, client) as mirror:
        rev = await ordinary_write(etcd, layout, 1)
        assert await mirror.wait_revision(rev, 10)
        client.held = True
        target = await ordinary_write(etcd, layout, 2)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while mirror.revision < target:
            assert loop.time() < deadline, f"the mirror never caught up: {mirror.stats()}"
            # Once the stall was noticed, nothing but a delivery of the missing revisions may make
            # the mirror read "connected" again.
            if mirror.disconnects:
                assert not (mirror.connected and mirror.revision < target), (
                    f"connected while behind a stalled watch: {mirror.stats()}")
            await asyncio.sleep(0.01)
        assert mirror.disconnects >= 1, "the stall was noticed"
        assert 2 in mirror.blocks("small")
        # Caught up by a snapshot, it follows the watch again once the stream delivers.
        client.held = False
        rev = await ordinary_write(etcd, layout, 3)
        assert await mirror.wait_revision(rev, 10)
        await eventually(lambda: mirror.connected, 5, "connected once the stream delivers")

