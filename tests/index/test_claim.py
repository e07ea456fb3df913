"""An instance id held by a live process is refused; one a crashed process left is taken over
(real etcd, real leases)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest

from index.claim import ensure_id_free
from index.errors import InstanceIdInUse
from index.etcd import EtcdClient
from index.keys import KeyLayout, dumps
from index.lease import LeaseSession

TTL = 3  # the window looked at is TTL/3 + 1 s


async def test_a_free_or_unleased_id_is_taken_at_once(etcd: EtcdClient,
                                                      layout: KeyLayout) -> None:
    key = layout.instance("fresh")
    t0 = time.monotonic()
    await ensure_id_free(etcd, key, "fresh")
    await etcd.put(key, dumps({"role": "prefill"}))  # no lease: nobody can be renewing it
    await ensure_id_free(etcd, key, "fresh")
    assert time.monotonic() - t0 < 1.0


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
        etcd: EtcdClient, layout: KeyLayout) -> None:
    """The lease reading alone is not trusted where the record names an address."""
    key = layout.instance("silent")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    async with renewed_record(etcd, key, {"role": "prefill", "bootstrap_host": "127.0.0.1",
                                          "bootstrap_port": port}):
        await ensure_id_free(etcd, key, "silent")


async def test_an_id_a_crashed_process_left_is_taken_over(etcd: EtcdClient,
                                                          layout: KeyLayout) -> None:
    key = layout.instance("crashed")
    lease, _ = await etcd.grant(TTL * 4)  # granted, then never renewed: its holder died
    await etcd.put(key, dumps({"role": "prefill", "bootstrap_host": "h", "bootstrap_port": 1}),
                   lease)
    t0 = time.monotonic()
    await ensure_id_free(etcd, key, "crashed")
    # It looked for one renewal period of the holder (its TTL / 3 + 1 s), not for the whole TTL.
    assert TTL * 4 / 3 <= time.monotonic() - t0 < TTL * 4 - 2
    await etcd.revoke(lease)


async def test_only_a_record_of_the_same_kind_counts(etcd: EtcdClient, layout: KeyLayout) -> None:
    """An index agent shares its id with the instance's bootstrap server by design."""
    key = layout.instance("shared")
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with renewed_record(etcd, key, {"role": "prefill", "bootstrap_host": "127.0.0.1",
                                              "bootstrap_port": port}):
            t0 = time.monotonic()
            await ensure_id_free(etcd, key, "shared", source="kv-events")  # the agent: fine
            assert time.monotonic() - t0 < 1.0
        async with renewed_record(etcd, key, {"role": "prefill", "source": "kv-events"}):
            await ensure_id_free(etcd, key, "shared")  # the server: fine
            with pytest.raises(InstanceIdInUse):  # a second agent: refused
                await ensure_id_free(etcd, key, "shared", source="kv-events")
    finally:
        server.close()
        await server.wait_closed()
