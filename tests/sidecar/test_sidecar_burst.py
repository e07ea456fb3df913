"""A million one-block KV events in a burst into a sidecar (in-process, real etcd, real ZMQ, a
real HTTP engine stand-in): the lease that holds the instance record is kept throughout, and the
index converges to what the burst left stored."""
from __future__ import annotations

import time

import pytest
from event_burst import make_burst
from sidecar_stubs import BootstrapStub, EngineStub, rank_body
from test_sidecar import config, running
from waiting import wait_until

from bootstrap.registration import put_route
from index.etcd import EtcdClient, EtcdSettings
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.events.types import KVEventBatch
from index.keys import KeyLayout
from index.segments import held_blocks
from kvatlas.etcd_proc import free_ports
from sidecar.service import ATTACHED

pytestmark = pytest.mark.timeout(240)


async def test_a_million_event_burst_keeps_the_sidecars_lease_and_record_and_the_index_converges(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    burst = make_burst(16)
    assert burst.stored_events == 1_000_000
    engine = await EngineStub().start()
    boot = await BootstrapStub("e0").start()
    await put_route(boot.url, rank_body(0, 1, 21000))
    events, replay = (f"tcp://127.0.0.1:{p}" for p in free_ports(2))
    cfg = config(etcd_settings, key_prefix, engine.url, role="prefill", bootstrap_url=boot.url,
                 events=SubscriberConfig(endpoint=events, replay_endpoint=replay))
    pub = KVEventPublisher(PublisherConfig(endpoint=events, replay_endpoint=replay))
    try:
        await pub.start()
        async with running(cfg) as (sc, _):
            att = await wait_until(lambda: sc.attachment if sc.state == ATTACHED else None,
                                   what="the sidecar attached the engine")
            ingestor, sub = att.subscribed[0]

            def heartbeat_seen() -> bool:
                # Once a heartbeat arrives the subscription has reached the publisher.
                if pub.next_seq and ingestor.stats.last_seq == pub.next_seq - 1:
                    return True
                pub.publish(KVEventBatch(time.time(), []))
                return False
            await wait_until(heartbeat_seen, what="a heartbeat batch reached the sidecar")
            record_key = layout.instance("e0")
            before = await wait_until(lambda: etcd.get(record_key),
                                      what="the sidecar wrote the instance record")
            lease = att.session.lease_id
            assert lease is not None and before.lease == lease
            applied0 = ingestor.stats.applied

            last = burst.send(pub)  # ~15 s of ingestion at least, five TTLs

            await wait_until(lambda: ingestor.stats.last_seq == last, timeout=180,
                             what=f"the sidecar applied the burst up to seq {last}",
                             detail=sub.stats)
            final = burst.final_blocks()

            async def converged() -> bool:
                _, kvs = await etcd.get_prefix(layout.blocks_prefix("tiny", "e0"))
                return set(held_blocks(kv.value for kv in kvs)) == final
            assert att.writer is not None
            await wait_until(converged, timeout=60, what="etcd holds the blocks the burst "
                             "left stored", detail=att.writer.stats)
            # Never expired: an expired lease never comes back, and a regrant has a new id.
            after = await etcd.get(record_key)
            assert after is not None and after.lease == lease, (before, after)
            assert await etcd.lease_ttl(lease) > 0
            assert att.session.generation == 1 and sc.attachments == 1
            assert ingestor.stats.applied - applied0 == burst.events
            assert not ingestor.stats.rejected, ingestor.stats.as_dict()
    finally:
        await pub.close()
        await boot.stop()
        await engine.stop()
