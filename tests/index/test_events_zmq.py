"""KV events over real ZMQ sockets on loopback: publisher, replay ROUTER and subscriber."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio
from kv_sim import SimEngine, own
from memory_index import MemoryBlockIndex
from waiting import wait_until

from index.events.codec import END_SEQ, decode_payload, encode_message, encode_payload
from index.events.endpoints import connectable, offset_endpoint, publisher_binds
from index.events.ingest import InstanceIngestor
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import KVEventSubscriber, SubscriberConfig
from index.events.types import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch
from kvatlas.etcd_proc import free_port

BS = 4
pytestmark = pytest.mark.timeout(60)


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def workload(n: int) -> list[list[KVEvent]]:
    """n batches of engine events: prompts growing block by block, some evictions."""
    eng = SimEngine(BS, "signed")
    out: list[list[KVEvent]] = []
    for i in range(n):
        base = (i // 4) * 10_000
        step = i % 4
        tokens = list(range(base, base + (step + 1) * 2 * BS))
        evs: list[KVEvent] = [eng.vllm_store(tokens, start_block=step * 2)]
        if step == 3 and i % 8 == 7:
            evs.append(eng.remove(tokens, [7]))
        out.append(evs)
    return out


async def expected_index(batches: list[list[KVEvent]]) -> MemoryBlockIndex:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS)
    for seq, evs in enumerate(batches):
        await ing.on_batch(seq, decode_payload(encode_payload(KVEventBatch(0.0, evs))))
    assert not ing.stats.rejected
    return idx


@pytest.fixture
async def cleanup() -> AsyncIterator[list]:
    things: list = []
    yield things
    for t in reversed(things):
        await t.close()


async def start_sub(cleanup: list, endpoint: str, replay: str | None, **kw: object) -> KVEventSubscriber:
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=BS, replay=replay is not None)
    sub = KVEventSubscriber(SubscriberConfig(endpoint=endpoint, replay_endpoint=replay, **kw), ing)  # type: ignore[arg-type]
    await sub.start()
    cleanup.append(sub)
    return sub


async def test_slow_joiner_recovers_everything_through_replay(cleanup: list) -> None:
    """The publisher connects (concrete host), so the consumer binds; batches published before
    the consumer exists are lost on PUB/SUB and come back through the real ROUTER."""
    ep, rep = tcp(), tcp()
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep, encoding="array"))
    await pub.start()
    cleanup.append(pub)
    batches = workload(24)
    for evs in batches[:10]:
        pub.drain(list(evs))
    sub = await start_sub(cleanup, ep, rep)
    assert sub.config.binds
    i = 10
    deadline = time.monotonic() + 20
    # Keep publishing (as an engine does) until everything is in.
    while sub.ingestor.stats.last_seq != len(batches) - 1:
        if i < len(batches):
            pub.drain(list(batches[i]))
            i += 1
        await asyncio.sleep(0.02)
        assert time.monotonic() < deadline, sub.stats()
    want = await expected_index(batches)
    got = sub.ingestor.index
    assert got.blocks("p0") == want.blocks("p0") and got.blocks("p0")
    assert pub.replay_requests >= 1 and sub.ingestor.stats.replays >= 1
    assert sub.ingestor.state == "synced" and sub.ingestor.stats.clears == 0
    assert not sub.malformed and not sub.ingestor.stats.rejected


async def test_publisher_connections_are_watched_so_nothing_is_published_into_the_void(
        cleanup: list) -> None:
    """The subscriber knows when a publisher is connected: a batch published after
    ``wait_publisher`` returns arrives with no replay, and a publisher that goes away is
    counted out."""
    ep = tcp()
    sub = await start_sub(cleanup, ep, None)
    assert not await sub.wait_publisher(0.3)
    assert sub.stats()["publishers"] == 0
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=None))
    await pub.start()
    assert await sub.wait_publisher(10)
    assert sub.publishers == 1 and sub.connections == 1
    batches = workload(1)
    # The subscription follows the handshake by a loopback hop that a PUB socket does not report
    # (no state to wait on): this slack is the contract wait_publisher documents. What makes an
    # instance routable (an etcd write, a router's watch, a request) takes far longer.
    await asyncio.sleep(0.2)
    pub.drain(list(batches[0]))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 0, what="seq 0, never replayed")
    assert sub.ingestor.stats.gaps == 0
    await pub.close()
    await wait_until(lambda: sub.publishers == 0, what="the publisher counted out")
    assert not await sub.wait_publisher(0.1)


class Forwarder:
    """A raw XPUB connected to the subscriber: sends exactly the frames a test chooses (as a lossy
    network would deliver them) and knows when the subscription has arrived."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def wait_subscribed(self) -> None:
        msg = await asyncio.wait_for(self.sock.recv(), 10)
        assert msg[:1] == b"\x01"

    async def send(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def close(self) -> None:
        self.sock.close()
        self.ctx.term()


async def lossy_setup(cleanup: list, replay: bool) -> tuple[KVEventPublisher, KVEventSubscriber, Forwarder]:
    """A real publisher whose live stream goes nowhere (its ROUTER is real), and a subscriber fed
    by a forwarder that drops what the test leaves out."""
    sub_ep, dead_ep, rep = tcp(), tcp(), tcp()
    pub = KVEventPublisher(PublisherConfig(endpoint=dead_ep, replay_endpoint=rep))
    await pub.start()
    cleanup.append(pub)
    sub = await start_sub(cleanup, sub_ep, rep if replay else None, replay_timeout=2.0)
    fwd = Forwarder(sub_ep)
    cleanup.append(fwd)
    await fwd.wait_subscribed()
    return pub, sub, fwd


def frames_of(pub: KVEventPublisher, seq: int) -> list[bytes]:
    [(s, payload)] = [x for x in pub.replay_from(seq) if x[0] == seq]
    return [b"", s.to_bytes(8, "big"), payload]


async def test_mid_stream_gap_is_replayed_from_the_router(cleanup: list) -> None:
    pub, sub, fwd = await lossy_setup(cleanup, replay=True)
    batches = workload(8)
    for evs in batches:
        pub.drain(list(evs))
    for seq in (0, 1, 2):
        await fwd.send(frames_of(pub, seq))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 2, what="seq 2")
    for seq in (5, 6, 7):  # 3 and 4 lost on the way
        await fwd.send(frames_of(pub, seq))
    await wait_until(lambda: sub.received >= 3 + 3 + 5, what="replay and live tail")
    await wait_until(lambda: sub.ingestor.stats.last_seq == 7, what="seq 7")
    want = await expected_index(batches)
    assert sub.ingestor.index.blocks("p0") == want.blocks("p0")
    st = sub.ingestor.stats
    assert pub.replay_requests == 1 and st.replays == 1 and st.gaps == 1
    assert st.clears == 0 and st.restarts == 0 and st.duplicates >= 2
    assert sub.ingestor.state == "synced"


async def test_gap_without_replay_clears_then_restart_clears(cleanup: list) -> None:
    pub, sub, fwd = await lossy_setup(cleanup, replay=False)
    batches = workload(8)
    for evs in batches:
        pub.drain(list(evs))
    for seq in (0, 1):
        await fwd.send(frames_of(pub, seq))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 1, what="seq 1")
    assert sub.ingestor.index.blocks("p0")
    await fwd.send(frames_of(pub, 3))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 3, what="seq 3")
    ing = sub.ingestor
    assert ing.state == "resyncing" and ing.stats.gaps == 1 and ing.stats.clears == 1
    assert ing.index.blocks("p0") == set()  # seq 3 continues a chain whose start was cleared
    assert ing.stats.rejected == {"unknown_parent": 1}
    # The engine restarts: its sequence starts over at 0.
    fresh = KVEventBatch(1.0, [SimEngine(BS, salt=b"run2").vllm_store(list(range(2 * BS)))])
    await fwd.send(encode_message(b"", 0, fresh))
    await wait_until(lambda: ing.stats.restarts == 1, what="restart")
    assert ing.index.lookup(own(list(range(2 * BS)), BS)) == {"p0": 2}
    assert ing.stats.last_seq == 0 and ing.state == "synced"


async def test_malformed_messages_are_counted_and_never_stop_the_reader(cleanup: list) -> None:
    sub_ep = tcp()
    sub = await start_sub(cleanup, sub_ep, None, model="m1")
    fwd = Forwarder(sub_ep)
    cleanup.append(fwd)
    await fwd.wait_subscribed()
    seq0 = (0).to_bytes(8, "big")
    await fwd.send([b"only-two", seq0])
    await fwd.send([b"", seq0, b"\x93\x01"])  # truncated msgpack
    await fwd.send([b"", seq0, msgpack.packb([1.0, [["BlockStored", ["x"], None, [1], 1]]])])
    huge = msgpack.packb([1.0, [["BlockStored", [1], None, [1] * 2_000_000, 2_000_000]]])
    await fwd.send([b"", seq0, huge])  # more tokens than any one event may carry
    await fwd.send([b"kv@pod-a@other-model", seq0, msgpack.packb([1.0, []])])
    tokens = list(range(3 * BS))
    good = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1, 2, 3],
                                 "parent_block_hash": None, "token_ids": tokens, "block_size": BS}]])
    await fwd.send([b"kv@pod-a@m1", seq0, good])
    await wait_until(lambda: sub.ingestor.stats.last_seq == 0, what="the good message")
    assert sub.ingestor.index.lookup(own(tokens, BS)) == {"p0": 3}
    assert sub.malformed == {"frame_count": 1, "bad_msgpack": 1, "bad_hash": 1, "too_large": 1,
                             "unknown_model": 1}
    assert sub.running


async def test_publisher_binds_ipc_and_drains_the_engine_list(cleanup: list, tmp_path) -> None:
    ep = f"ipc://{tmp_path}/kv.sock"
    assert publisher_binds(ep)
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, topic="kv@p0@m"))
    await pub.start()
    cleanup.append(pub)
    sub = await start_sub(cleanup, ep, None, topic="kv@p0")
    assert not sub.config.binds
    eng = SimEngine(BS)
    tokens = list(range(4 * BS))
    pending: list[KVEvent] = []
    assert pub.drain(pending) is None  # nothing to publish
    seq = 0
    while sub.ingestor.stats.last_seq is None:  # slow joiner: keep sending until one arrives
        pending.append(eng.vllm_store(tokens))
        seq = pub.drain(pending)  # type: ignore[assignment]
        assert pending == []
        await asyncio.sleep(0.02)
        assert seq < 500
    await wait_until(lambda: sub.ingestor.stats.last_seq == seq, what="last seq")
    assert sub.ingestor.index.lookup(own(tokens, BS)) == {"p0": 4}
    pending.append(AllBlocksCleared())
    cleared = pub.drain(pending)
    await wait_until(lambda: sub.ingestor.stats.last_seq == cleared, what="clear")
    assert sub.ingestor.index.instances() == set()


async def test_replay_router_protocol(cleanup: list) -> None:
    rep = tcp()
    pub = KVEventPublisher(PublisherConfig(endpoint=tcp(), replay_endpoint=rep, buffer_steps=5,
                                           topic="t"))
    await pub.start()
    cleanup.append(pub)
    for i in range(8):
        pub.publish(KVEventBatch(float(i), []))
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        await dealer.send_multipart([b"only-one-frame"])  # ignored, counted
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 5)
            assert len(msg) == 4 and msg[0] == b""
            if msg[2] == END_SEQ:
                assert msg[1] == b"" and msg[3] == b""
                break
            assert msg[1] == b"t"
            got.append((int.from_bytes(msg[2], "big"), decode_payload(msg[3]).ts))
        assert got == [(s, float(s)) for s in range(3, 8)]  # only the last 5 are kept
        await dealer.send_multipart([b"", (100).to_bytes(8, "big")])
        msg = await asyncio.wait_for(dealer.recv_multipart(), 5)
        assert msg[2] == END_SEQ
        assert pub.bad_replay_requests == 1 and pub.replay_requests == 2
    finally:
        dealer.close()
        ctx.term()


def test_endpoint_rules() -> None:
    assert publisher_binds("tcp://*:5557") and publisher_binds("tcp://0.0.0.0:5557")
    assert publisher_binds("tcp://[::]:5557") and publisher_binds("ipc:///tmp/x")
    assert publisher_binds("inproc://x")
    assert not publisher_binds("tcp://127.0.0.1:5557") and not publisher_binds("tcp://host-a:5557")
    assert connectable("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    for bad in ("tcp://host", "http://x:1", "tcp://h:99999"):
        with pytest.raises(ValueError):
            publisher_binds(bad)
    with pytest.raises(ValueError):
        PublisherConfig(endpoint="tcp://127.0.0.1:1", replay_endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ValueError):
        PublisherConfig(buffer_steps=0)
    with pytest.raises(ValueError):
        SubscriberConfig(replay_timeout=0)
    assert SubscriberConfig(endpoint="tcp://*:1").binds is False
    assert SubscriberConfig(endpoint="tcp://127.0.0.1:1").binds is True
    assert SubscriberConfig(endpoint="tcp://10.0.0.5:1", connect=True).binds is False


async def test_replay_endpoint_without_router_times_out_and_resyncs(cleanup: list) -> None:
    sub_ep = tcp()
    sub = await start_sub(cleanup, sub_ep, tcp(), replay_timeout=0.3)  # nobody serves replay
    fwd = Forwarder(sub_ep)
    cleanup.append(fwd)
    await fwd.wait_subscribed()
    eng = SimEngine(BS)
    tokens = list(range(2 * BS))
    await fwd.send(encode_message(b"", 0, KVEventBatch(0.0, [eng.vllm_store(tokens)])))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 0, what="seq 0")
    other = list(range(900, 900 + BS))
    await fwd.send(encode_message(b"", 4, KVEventBatch(0.0, [eng.vllm_store(other)])))
    await wait_until(lambda: sub.ingestor.stats.last_seq == 4, what="seq 4 after the failed replay")
    ing = sub.ingestor
    assert ing.stats.replays == 1 and ing.stats.replay_failures == 1
    assert ing.state == "resyncing"
    assert ing.index.blocks("p0") == set(own(other, BS))  # cleared, then seq 4 applied
    await fwd.send(encode_message(b"", 5, KVEventBatch(0.0, [AllBlocksCleared()])))
    await wait_until(lambda: ing.state == "synced", what="AllBlocksCleared ends resync")


async def test_long_replay_is_not_cut_at_the_high_water_mark(cleanup: list) -> None:
    """A full 10,000-batch buffer of 5 kB batches replays completely, in order (ten times the
    default high-water mark, past which a ROUTER without ROUTER_MANDATORY may drop)."""
    rep = tcp()
    pub = KVEventPublisher(PublisherConfig(endpoint=tcp(), replay_endpoint=rep))
    await pub.start()
    cleanup.append(pub)
    # 5 kB per batch, so that kernel socket buffers cannot absorb the whole replay.
    big = KVEventBatch(0.0, [BlockStored([1], None, [2**31] * 1024, 1024)])
    for _ in range(10_000):
        pub.publish(big)
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            msg = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if msg[2] == END_SEQ:
                break
            seqs.append(int.from_bytes(msg[2], "big"))
        assert seqs == list(range(10_000))
    finally:
        dealer.close()
        ctx.term()
