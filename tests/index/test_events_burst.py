"""A KV-event burst against a real index agent (real ZMQ, real etcd): ingestion hands the event
loop back between bounded slices, so the lease keepalive runs throughout; a flood past the
high-water marks is counted as dropped and filled by replay."""
from __future__ import annotations

import pytest
from agent_helpers import closers, publish_all, tcp  # noqa: F401 (closers: a fixture)
from event_burst import make_burst
from memory_index import MemoryBlockIndex
from waiting import wait_until

from index.agent import AgentConfig, IndexAgent
from index.agent_stats import stats_key
from index.etcd import EtcdClient, EtcdSettings
from index.events.feed import EventFeed
from index.events.ingest import InstanceIngestor
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.events.types import BlockStored
from index.hashing import block_hashes
from index.keys import KeyLayout, loads
from index.segments import held_blocks

pytestmark = pytest.mark.timeout(240)

MODEL = "burst-model"


async def start_pair(closers: list, etcd_endpoint: str, key_prefix: str, instance_id: str,
                     block_size: int, sub_hwm: int = 100_000, pub_hwm: int = 100_000
                     ) -> tuple[IndexAgent, KVEventPublisher]:
    ep, rep = tcp(), tcp()
    agent = IndexAgent(AgentConfig(
        instance_id=instance_id, model=MODEL, block_size=block_size,
        events=SubscriberConfig(endpoint=ep, replay_endpoint=rep, hwm=sub_hwm),
        etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0), etcd_prefix=key_prefix,
        lease_ttl=3, stats_interval=0.2, record_check_interval=0.2))
    await agent.start()
    closers.append(agent)
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep, hwm=pub_hwm))
    await pub.start()
    closers.append(pub)
    # Heartbeats until one arrives: the subscription has reached the publisher.
    await publish_all(pub, [], lambda: agent.ingestor.stats.last_seq)
    return agent, pub


async def indexed(etcd: EtcdClient, layout: KeyLayout, instance_id: str) -> set[int]:
    _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL, instance_id))
    return set(held_blocks(kv.value for kv in kvs))


async def test_a_million_event_burst_keeps_the_agents_lease_and_record_and_the_index_converges(
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout,
        closers: list) -> None:
    burst = make_burst(16)
    assert burst.stored_events == 1_000_000
    agent, pub = await start_pair(closers, etcd_endpoint, key_prefix, "burst-0", 16)
    record_key = layout.instance("burst-0")
    before = await wait_until(lambda: etcd.get(record_key),
                              what="the agent wrote the instance record")
    lease = agent.session.lease_id
    assert lease is not None and before.lease == lease
    applied0 = agent.ingestor.stats.applied

    last = burst.send(pub)  # ~15 s of ingestion at least, five TTLs

    await wait_until(lambda: agent.ingestor.stats.last_seq == last, timeout=180,
                     what=f"the agent applied the burst up to seq {last}",
                     detail=lambda: agent.stats()["subscriber"])
    final = burst.final_blocks()
    await wait_until(lambda: holds(etcd, layout, "burst-0", final), timeout=60,
                     what="etcd holds the blocks the burst left stored",
                     detail=agent.writer.stats)
    # The lease the record was written under is the one it has now, and still alive: it never
    # expired (an expired lease never comes back; a regrant would show a new id).
    after = await etcd.get(record_key)
    assert after is not None and after.lease == lease, (before, after)
    assert await etcd.lease_ttl(lease) > 0
    assert agent.session.generation == 1 and agent.session.lease_id == lease
    st = agent.ingestor.stats
    assert st.applied - applied0 == burst.events and not st.rejected, st.as_dict()
    assert agent.subscriber.stats()["yields"] > 0
    doc = await wait_until(lambda: _stats_doc(etcd, layout, "burst-0", last),
                           what="the stats key shows the burst applied")
    assert doc["blocks"] == len(final) and doc["state"] == "synced" and "dropped" in doc


async def test_a_flood_past_the_high_water_marks_is_counted_as_dropped_and_replayed(
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout,
        closers: list) -> None:
    # Big messages (256-token blocks) and one-message queues: far more than the sockets and
    # the kernel's buffers hold is sent at once, so the publisher drops most of it.
    burst = make_burst(256, events=100_000)
    agent, pub = await start_pair(closers, etcd_endpoint, key_prefix, "flood-0", 256,
                                  sub_hwm=1, pub_hwm=1)
    last = burst.send(pub)

    def caught_up() -> bool:
        # The publisher may drop the flood's last messages too: then nothing tells the agent
        # they existed until the engine publishes again, as an engine does. So the test
        # publishes the last message once more (the final blocks stay the same) until the
        # agent applied the newest one and no replay is still filling a gap.
        nonlocal last
        if agent.ingestor.stats.last_seq == last and agent.ingestor.state == "synced":
            return True
        if agent.ingestor.state == "synced":
            last = burst.send_last_again(pub)
        return False

    await wait_until(caught_up, timeout=120, interval=0.5,
                     what="the agent applied the flood's newest message and is synced",
                     detail=lambda: (last, agent.ingestor.state, agent.stats()["subscriber"]))
    st = agent.ingestor.stats
    assert st.dropped > 0 and st.replays > 0 and st.replay_failures == 0, st.as_dict()
    assert not st.rejected, st.as_dict()
    final = burst.final_blocks()
    await wait_until(lambda: holds(etcd, layout, "flood-0", final), timeout=60,
                     what="etcd holds the blocks the flood left stored",
                     detail=agent.writer.stats)
    doc = await wait_until(lambda: _stats_doc(etcd, layout, "flood-0", last),
                           what="the stats key shows the flood applied")
    assert doc["dropped"] == st.dropped


async def holds(etcd: EtcdClient, layout: KeyLayout, instance_id: str, want: set[int]) -> bool:
    return await indexed(etcd, layout, instance_id) == want


async def _stats_doc(etcd: EtcdClient, layout: KeyLayout, instance_id: str,
                     last: int) -> dict | None:
    kv = await etcd.get(stats_key(layout, instance_id))
    doc = loads(kv.value) if kv is not None else None
    return doc if doc and doc.get("last_seq") == last else None


async def test_the_prefill_feed_drops_past_its_bound_counts_it_and_resyncs_the_instance() -> None:
    index = MemoryBlockIndex()
    feed = EventFeed(InstanceIngestor(index, "p0", block_size=16), max_queued=2)
    feed.start()
    try:
        # Five batches from the engine's synchronous sink before the feed's task gets a turn.
        for i in range(5):
            feed.sink([BlockStored([i + 1], None, [i] * 16, 16)])
        assert feed.dropped == 3
        await wait_until(lambda: feed.ingestor.stats.last_seq == 1,
                         what="the feed applied the two batches it kept")
        # The next batch after the dropped ones shows the gap: cleared and resyncing.
        feed.sink([BlockStored([9], None, [9] * 16, 16)])
        await wait_until(lambda: feed.ingestor.stats.last_seq == 5,
                         what="the feed applied the batch after the dropped ones")
        st = feed.ingestor.stats
        assert st.dropped == 3 and st.gaps == 1 and feed.ingestor.state == "resyncing"
        assert index.blocks("p0") == set(block_hashes([9] * 16, 16))
    finally:
        await feed.close()
