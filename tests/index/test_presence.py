"""``index.presence.InstancePresence`` against a real etcd: the one way a process shows itself
(connect, claim the id, lease, keys, keepalive, close with or without a revoke)."""
from __future__ import annotations

import pytest
from waiting import wait_until

from index.errors import InstanceIdInUse
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.presence import Claim, InstancePresence
from index.record import InstanceRecord

pytestmark = pytest.mark.timeout(60)


def presence(etcd_endpoint: str, layout: KeyLayout, iid: str, ttl: int = 3) -> InstancePresence:
    p = InstancePresence(EtcdClient(EtcdSettings.from_text(etcd_endpoint, timeout=3.0)), ttl,
                         owned_prefixes=[layout.ranks_prefix(iid)],
                         claim=Claim(layout.instance(iid), iid), name=f"test-{iid}")
    rec = InstanceRecord(instance_id=iid, role="decode", model="m", started_at=0.0)
    p.keys.set(layout.instance(iid), rec.to_json())
    return p


async def test_open_writes_under_the_lease_and_close_revokes(
        etcd: EtcdClient, etcd_endpoint: str, layout: KeyLayout) -> None:
    p = presence(etcd_endpoint, layout, "pres-a")
    await p.open()
    assert await p.keys.wait_synced(10), "the record never reached etcd"
    kv = await etcd.get(layout.instance("pres-a"))
    assert kv is not None and kv.lease == p.session.lease_id
    await p.close()
    assert await etcd.get(layout.instance("pres-a")) is None, "a clean close left the record"
    assert not p.running and p.session.lease_id is None


async def test_close_without_revoke_leaves_the_keys_to_their_ttl(
        etcd: EtcdClient, etcd_endpoint: str, layout: KeyLayout) -> None:
    p = presence(etcd_endpoint, layout, "pres-b")
    await p.open()
    assert await p.keys.wait_synced(10), "the record never reached etcd"
    lease = p.session.lease_id
    assert lease is not None
    await p.close(revoke=False)
    kv = await etcd.get(layout.instance("pres-b"))
    assert kv is not None and kv.lease == lease, "the keys must outlive a crash-like close"
    assert await etcd.lease_ttl(lease) > 0
    await etcd.revoke(lease)


async def test_a_second_holder_of_a_live_id_is_refused_and_its_client_closed(
        etcd_endpoint: str, layout: KeyLayout) -> None:
    first = presence(etcd_endpoint, layout, "pres-c")
    await first.open()
    try:
        assert await first.keys.wait_synced(10), "the first record never reached etcd"
        second = presence(etcd_endpoint, layout, "pres-c")
        with pytest.raises(InstanceIdInUse, match="pres-c"):
            await second.open()
        assert not second.running, "a refused presence started its lease"
        assert second.session.lease_id is None
    finally:
        await first.close()


async def test_a_shared_client_outlives_its_presences(
        etcd: EtcdClient, etcd_endpoint: str, layout: KeyLayout) -> None:
    """A sidecar's attachments and a router's predictions share the process's client: closing
    one presence revokes its lease and leaves the client serving the next one."""
    client = EtcdClient(EtcdSettings.from_text(etcd_endpoint, timeout=3.0))
    await client.connect()
    try:
        for n in range(2):
            p = InstancePresence(client, 3, owns_client=False, name=f"shared-{n}")
            key = layout.instance(f"shared-{n}")
            p.keys.set(key, b"{}")
            p.start()
            assert await p.keys.wait_synced(10), f"presence {n} never synced"
            await p.close()
            assert await etcd.get(key) is None, f"presence {n}'s key survived its revoke"
        assert await client.get(layout.instance("shared-0")) is None  # still usable
    finally:
        await client.close()


async def test_a_lost_lease_is_regranted_and_the_keys_rewritten(
        etcd: EtcdClient, etcd_endpoint: str, layout: KeyLayout) -> None:
    p = presence(etcd_endpoint, layout, "pres-d")
    await p.open()
    try:
        assert await p.keys.wait_synced(10), "the record never reached etcd"
        old = p.session.lease_id
        assert old is not None
        await etcd.revoke(old)  # etcd forgets the lease and its keys

        async def rewritten() -> bool:
            kv = await etcd.get(layout.instance("pres-d"))
            return kv is not None and kv.lease not in (0, old)
        await wait_until(rewritten, what="the record rewritten under a new lease", timeout=20)
    finally:
        await p.close()
