"""``index.pipeline``: ingestion -> DP union -> writer -> shard lease, wired, started and closed
in one order (real etcd, real ZMQ publishers), and ingestion writing to a synchronous sink."""
from __future__ import annotations

import contextlib

import pytest
from agent_helpers import closers, publish_all, tcp  # noqa: F401
from kv_sim import SimEngine, own
from start_checks import port_free
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.keys import KeyLayout
from index.pipeline import BlockPipeline, open_block_pipeline
from index.presence import InstancePresence
from index.shards import IndexShards
from index.writer import BlockWriter

pytestmark = pytest.mark.timeout(60)

BS = 16
MODEL = "org/pipeline-model"
PROMPT = list(range(500, 500 + 4 * BS))


async def test_dp_union_views_are_synchronous_sinks_over_the_writer(
        etcd_endpoint: str, layout: KeyLayout) -> None:
    """Two DP groups holding one block: the writer holds it until the last group drops it, and
    each change is in the writer as soon as the sink call returns (nothing awaited)."""
    client = EtcdClient(EtcdSettings.from_text(etcd_endpoint))
    p = InstancePresence(client, 3)
    pipe = BlockPipeline(p.session, IndexShards(), layout, MODEL, "pipe-0", block_size=BS,
                         sources=[(1, SubscriberConfig(endpoint=tcp()))], local=True)
    assert pipe.union is not None and isinstance(pipe.writer, BlockWriter)
    hs = own(PROMPT, BS)
    g0, g1 = pipe.sink(0), pipe.sink(1)
    g0.add(None, hs[:3])
    g1.add(hs[0], hs[1:4], "CPU")
    assert set(pipe.writer.blocks()) == set(hs[:4])
    g0.remove(hs[:3])
    assert set(pipe.writer.blocks()) == set(hs[1:4]), "a block another group holds was dropped"
    g1.clear()
    assert len(pipe.writer) == 0
    await pipe.close()  # never started: harmless
    await client.close()


async def test_one_stream_writes_to_the_writer_itself(etcd_endpoint: str,
                                                      layout: KeyLayout) -> None:
    client = EtcdClient(EtcdSettings.from_text(etcd_endpoint))
    pipe = BlockPipeline(InstancePresence(client, 3).session, IndexShards(), layout, MODEL,
                         "pipe-1", block_size=BS, sources=[(0, SubscriberConfig(endpoint=tcp()))])
    assert pipe.union is None and pipe.sink(0) is pipe.writer
    assert pipe.ingestors[0].index is pipe.writer
    await pipe.close()
    await client.close()


async def test_events_reach_etcd_and_close_stops_in_order(
        closers: list, etcd: EtcdClient, etcd_endpoint: str,  # noqa: F811
        layout: KeyLayout) -> None:
    ep, rep = tcp(), tcp()
    port = int(ep.rsplit(":", 1)[1])
    presence = InstancePresence(EtcdClient(EtcdSettings.from_text(etcd_endpoint, timeout=3.0)), 3)
    await presence.open()
    closers.append(presence)
    stack = contextlib.AsyncExitStack()
    pipe = await open_block_pipeline(stack, presence.session, IndexShards(), layout, MODEL,
                                     "pipe-2", block_size=BS,
                                     sources=[(0, SubscriberConfig(endpoint=ep,
                                                                   replay_endpoint=rep))])
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep))
    await pub.start()
    closers.append(pub)
    eng = SimEngine(BS)
    await publish_all(pub, [[eng.vllm_store(PROMPT)]],
                      lambda: pipe.ingestors[0].stats.last_seq)
    assert await pipe.writer.wait_synced(10), "the writer never synced its blocks"
    _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL, "pipe-2"))
    assert kvs, "no block key of the instance in etcd"
    writer_task = pipe.writer_task
    assert writer_task is not None and not writer_task.done()
    await stack.aclose()
    # Subscribers first (their port is free again), then the writer.
    assert port_free(port), f"the subscriber still holds port {port}"
    assert writer_task.done() and pipe.writer_task is None
    await presence.close()
    await wait_until(lambda: _none_left(etcd, layout), what="the blocks gone with the lease")


async def _none_left(etcd: EtcdClient, layout: KeyLayout) -> bool:
    _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL, "pipe-2"))
    return not kvs
