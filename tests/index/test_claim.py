"""An instance id held by a live process is refused; one a crashed process left is taken over
(real etcd, real leases)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest

from index.claim import ensure_id_free
from index.errors import InstanceIdInUse
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, dumps
from index.lease import LeaseSession

TTL = 3  # the window looked at is TTL/3 + 1 s


class LeaseReadingClient(EtcdClient):
    """A real client that counts lease TTL reads: a claim that watches for a renewal reads the
    holder's lease twice, one taken at once reads it never."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.lease_reads = 0

    async def lease_ttls(self, lease_id: int) -> tuple[int, int]:
        self.lease_reads += 1
        return await super().lease_ttls(lease_id)


@pytest.fixture
async def reading(etcd_settings: EtcdSettings) -> AsyncIterator[LeaseReadingClient]:
    async with LeaseReadingClient(etcd_settings) as client:
        yield client


async def test_a_free_or_unleased_id_is_taken_at_once(etcd: EtcdClient, reading: LeaseReadingClient,
                                                      layout: KeyLayout) -> None:
    key = layout.instance("fresh")
    await ensure_id_free(reading, key, "fresh")
    await etcd.put(key, dumps({"role": "prefill"}))  # no lease: nobody can be renewing it
    await ensure_id_free(reading, key, "fresh")
    assert reading.lease_reads == 0, "it waited for a renewal nobody can make"


@contextlib.asynccontextmanager
async def renewed_record(etcd: EtcdClient, key: bytes, record: dict[str, object]
                         ) -> AsyncIterator[int]:
    """``record`` at ``key`` under a lease a live session keeps renewing; yields the lease."""
    holder = LeaseSession(etcd, TTL)
    task = asyncio.create_task(holder.run())
    try:
        lease = await holder.wait_lease()
        await etcd.put(key, dumps(record), lease)
        yield lease
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await holder.revoke()


async def test_an_id_held_by_a_live_process_is_refused(etcd: EtcdClient,
                                                       layout: KeyLayout) -> None:
    key = layout.instance("live")
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with renewed_record(etcd, key, {"role": "decode",
                                              "url": f"http://127.0.0.1:{port}"}) as lease:
            with pytest.raises(InstanceIdInUse) as info:
                await ensure_id_free(etcd, key, "live")
        err = info.value
        assert err.instance_id == "live" and err.lease == lease
        assert f"decode at 127.0.0.1:{port}" in str(err)
        assert "another --instance-id" in str(err)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_renewed_lease_whose_holder_does_not_listen_is_taken_over(
        etcd: EtcdClient, reading: LeaseReadingClient, layout: KeyLayout) -> None:
    """The lease reading alone is not trusted where the record names an address."""
    key = layout.instance("silent")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    async with renewed_record(etcd, key, {"role": "prefill", "bootstrap_host": "127.0.0.1",
                                          "bootstrap_port": port}) as lease:
        await ensure_id_free(reading, key, "silent")  # returns: the id is ours to take
        # It did look for a renewal (two readings of the lease), and the lease is alive and
        # renewed: only the silent address made it take the id over.
        assert reading.lease_reads == 2
        assert await etcd.lease_ttl(lease) > 0


async def test_an_id_a_crashed_process_left_is_taken_over(etcd: EtcdClient,
                                                          reading: LeaseReadingClient,
                                                          layout: KeyLayout) -> None:
    key = layout.instance("crashed")
    lease, _ = await etcd.grant(TTL * 4)  # granted, then never renewed: its holder died
    await etcd.put(key, dumps({"role": "prefill", "bootstrap_host": "h", "bootstrap_port": 1}),
                   lease)
    await ensure_id_free(reading, key, "crashed")
    # It looked for a renewal (two readings of the lease) and decided while the dead holder's
    # lease still runs: one renewal period of the holder, not the whole TTL.
    assert reading.lease_reads == 2
    assert await etcd.lease_ttl(lease) > 0, "it waited for the lease to expire"
    await etcd.revoke(lease)


async def test_only_a_record_of_the_same_kind_counts(etcd: EtcdClient, reading: LeaseReadingClient,
                                                     layout: KeyLayout) -> None:
    """An index agent shares its id with the instance's bootstrap server by design."""
    key = layout.instance("shared")
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with renewed_record(etcd, key, {"role": "prefill", "bootstrap_host": "127.0.0.1",
                                              "bootstrap_port": port}):
            await ensure_id_free(reading, key, "shared", source="kv-events")  # the agent: fine
            assert reading.lease_reads == 0, "another kind's lease was watched"
        async with renewed_record(etcd, key, {"role": "prefill", "source": "kv-events"}):
            await ensure_id_free(etcd, key, "shared")  # the server: fine
            with pytest.raises(InstanceIdInUse):  # a second agent: refused
                await ensure_id_free(etcd, key, "shared", source="kv-events")
    finally:
        server.close()
        await server.wait_closed()
