"""The etcd access layer against a real etcd: KV, transactions, leases, watch, error mapping."""
from __future__ import annotations

import asyncio

import pytest
from waiting import wait_until

from index.errors import EtcdCompacted, EtcdUnavailable, LeaseExpired
from index.etcd import Delete, EtcdClient, EtcdSettings, Put, parse_endpoints, prefix_end
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.owned import LeasedKeys
from kvatlas.etcd_proc import EtcdCluster, free_port


def test_parse_endpoints() -> None:
    assert parse_endpoints("127.0.0.1:2379") == ("127.0.0.1:2379",)
    assert parse_endpoints("http://a:1, b:2") == ("a:1", "b:2")
    for bad in ("", "nohost", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"


def test_key_layout_round_trips() -> None:
    lay = KeyLayout("/x")
    assert lay.instance("p0") == b"/x/v1/instances/p0"
    assert lay.parse_rank(lay.rank("p0", 1, 0, 3, 0)) == ("p0", (1, 0, 3, 0))
    key = lay.segment("org/model", "p0", 0xABC)
    assert key == b"/x/v2/blocks/org%2Fmodel/p0/0000000000000abc"
    assert lay.parse_segment(key) == ("org/model", "p0", 0xABC)
    assert key.startswith(lay.blocks_prefix("org/model", "p0"))
    assert lay.legacy_blocks_prefix() == b"/x/v1/blocks/"
    for bad in (b"/x/v2/blocks/m/p0/abc", b"/x/v2/blocks/m/p0/-000000000000001",
                b"/x/v2/blocks/m/0000000000000abc"):
        with pytest.raises(ValueError):
            lay.parse_segment(bad)
    with pytest.raises(ValueError):
        KeyLayout("x/")


async def test_put_get_txn_and_paged_prefix(etcd: EtcdClient, layout: KeyLayout) -> None:
    p = layout.root.encode()
    ops = [Put(p + b"k%05d" % i, b"v%d" % i) for i in range(128)]
    await etcd.txn(ops)
    for chunk in range(1, 100):  # more than one page of get_prefix (5000)
        await etcd.txn([Put(p + b"m%03d%03d" % (chunk, i), b"x") for i in range(100)])
    rev, kvs = await etcd.get_prefix(p)
    assert len(kvs) == 128 + 99 * 100
    assert rev > 0
    assert (await etcd.get(p + b"k00007")).value == b"v7"  # type: ignore[union-attr]
    await etcd.txn([Delete(p + b"m", prefix=True)])
    _, kvs = await etcd.get_prefix(p)
    assert len(kvs) == 128


async def test_lease_expiry_deletes_keys(etcd: EtcdClient, layout: KeyLayout) -> None:
    lease, ttl = await etcd.grant(2)
    assert ttl == 2
    key = layout.instance("dies")
    await etcd.put(key, b"{}", lease=lease)
    assert await etcd.get(key) is not None

    async def expired() -> bool:
        return await etcd.get(key) is None
    # 6 s for a 2 s TTL: the lease's expiry, not a revoke, deletes the key.
    await wait_until(expired, what="the lease expires and takes its key", timeout=6.0,
                     interval=0.2)
    with pytest.raises(LeaseExpired):
        await etcd.keepalive(lease)


async def test_watch_sees_puts_and_reports_compaction(etcd: EtcdClient, layout: KeyLayout) -> None:
    p = layout.root.encode()
    rev = await etcd.put(p + b"a", b"1")
    await etcd.put(p + b"b", b"2")
    await etcd.delete(p + b"a")
    seen = []
    async for batch in etcd.watch_prefix(p, rev):
        seen.extend((e.put, e.key[len(p):], e.value) for e in batch.events)
        if len(seen) >= 3:
            break
    assert seen == [(True, b"a", b"1"), (True, b"b", b"2"), (False, b"a", b"")]
    now = await etcd.put(p + b"c", b"3")
    await etcd.compact(now)
    with pytest.raises(EtcdCompacted) as info:
        async for _ in etcd.watch_prefix(p, rev):
            pass
    assert info.value.compact_revision == now


async def test_unreachable_etcd_maps_to_our_error() -> None:
    client = EtcdClient(EtcdSettings.from_text(f"127.0.0.1:{free_port()}", timeout=0.5))
    with pytest.raises(EtcdUnavailable) as info:
        await client.put(b"/x", b"y")
    assert "127.0.0.1" in str(info.value)
    await client.close()


async def test_leased_keys_converge_and_remove_stale(etcd: EtcdClient, layout: KeyLayout) -> None:
    owned = layout.ranks_prefix("p1")
    stale = layout.rank("p1", 9, 0, 0, 0)
    await etcd.put(stale, b"old")  # left by a previous run with the same id
    session = LeaseSession(etcd, ttl=3)
    keys = LeasedKeys(session, [owned])
    tasks = [asyncio.create_task(session.run()), asyncio.create_task(keys.run())]
    try:
        for i in range(300):
            keys.set(layout.rank("p1", 0, 0, i, 0), b'{"i":%d}' % i)
        assert await keys.wait_synced(5)
        _, kvs = await etcd.get_prefix(owned)
        assert len(kvs) == 300 and stale not in {kv.key for kv in kvs}
        assert all(kv.lease == session.lease_id for kv in kvs)
        keys.delete(layout.rank("p1", 0, 0, 0, 0))
        assert await keys.wait_synced(5)
        _, kvs = await etcd.get_prefix(owned)
        assert len(kvs) == 299
        # The lease vanishes behind our back (as after a long outage): keys come back under a new one.
        old = session.lease_id
        await etcd.revoke(old)  # type: ignore[arg-type]
        async def restored() -> bool:
            _, kvs = await etcd.get_prefix(owned)
            return len(kvs) == 299 and session.lease_id not in (None, old)
        await wait_until(restored, what="all 299 keys are back under a new lease",
                         timeout=30.0, interval=0.1)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.revoke()


async def test_three_member_cluster_survives_one_member_loss(etcd_cluster3: EtcdCluster) -> None:
    client = EtcdClient(EtcdSettings.from_text(etcd_cluster3.endpoints, timeout=2.0))
    try:
        await client.put(b"/k", b"1")
        etcd_cluster3.members[0].kill()
        async def written() -> bool:
            try:
                await client.put(b"/k", b"2")
            except EtcdUnavailable:
                return False
            return True
        # The channel fails over to a live member.
        await wait_until(written, what="a put succeeds on a live member", interval=0.2)
        assert (await client.get(b"/k")).value == b"2"  # type: ignore[union-attr]
    finally:
        await client.close()
