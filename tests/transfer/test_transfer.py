"""End-to-end transfers through real backends (zmq: real sockets; fake: in memory), real tensors."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import Rig, fast_config, layout, pages_of, pool
from waiting import wait_until

from transfer import TransferError, TransferState

pytestmark = pytest.mark.timeout(30)


async def run_pair(rig: Rig, room: int, src_ids: list[int], dst_ids: list[int], *,
                   dtype: torch.dtype = torch.bfloat16, config=None):
    lay = layout(dtype=dtype)
    src, dst = pool(lay, 32, seed=room), pool(lay, 32, seed=None)
    s = await rig.sender(lay, src, config)
    r = await rig.receiver(lay, dst, config)
    s.create(room)
    res, _ = await asyncio.gather(r.receive(room, [s.endpoint], dst_ids),
                                  s.send(room, src_ids, first_token=42, cached_tokens=3))
    return s, r, src, dst, res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
async def test_transfer_copies_exact_pages(rig: Rig, dtype: torch.dtype) -> None:
    src_ids, dst_ids = [5, 6, 7, 20, 2], [0, 31, 4, 5, 6]
    s, r, src, dst, res = await run_pair(rig, 77, src_ids, dst_ids, dtype=dtype)
    assert torch.equal(pages_of(dst, dst_ids), pages_of(src, src_ids))
    others = [p for p in range(32) if p not in dst_ids]
    assert bool((pages_of(dst, others).float() == -7.0).all())
    assert (res.room, res.first_token, res.cached_tokens, res.num_pages) == (77, 42, 3, 5)
    assert res.bytes_received == 5 * layout(dtype=dtype).page_bytes()
    assert s.poll(77) is TransferState.SUCCESS and r.poll(77) is TransferState.SUCCESS
    assert rig.released == []


@pytest.mark.parametrize("chunk_bytes, chunks", [
    (4096, 6),     # a layer of 10 pages is 5120 bytes: pages split, 8 + 2 per layer, 3 layers
    (10240, 2),    # two whole layers per chunk, then one
    (1 << 20, 1),
])
async def test_many_chunks(rig: Rig, chunk_bytes: int, chunks: int) -> None:
    ids = list(range(10))
    _, _, src, dst, res = await run_pair(rig, 5, ids, ids[::-1],
                                         config=fast_config(chunk_bytes=chunk_bytes))
    assert res.chunks == chunks
    assert torch.equal(pages_of(dst, ids[::-1]), pages_of(src, ids))


async def test_request_before_prefill_knows_room(rig: Rig) -> None:
    lay = layout()
    src, dst = pool(lay, 8, 1), pool(lay, 8, None)
    s, r = await rig.sender(lay, src), await rig.receiver(lay, dst)
    task = asyncio.create_task(r.receive(9, [s.endpoint], [1, 2]))
    # The request is already waiting at the prefill (kept as early, its room unknown there).
    await wait_until(lambda: len(s._early) == 1, what="the prefill holds the early request")
    assert r.poll(9) is TransferState.WAITING_FOR_INPUT and s.poll(9) is None
    s.create(9)
    assert s.poll(9) is TransferState.WAITING_FOR_INPUT
    dests = await s.wait_bootstrapped(9)
    assert [(d.num_pages, d.heads) for d in dests] == [(2, (0, 4))]
    await s.send(9, [3, 4], first_token=1, cached_tokens=0)
    await task
    assert torch.equal(pages_of(dst, [1, 2]), pages_of(src, [3, 4]))


async def test_room_mismatch_writes_nothing_and_frees_pages(rig: Rig) -> None:
    lay = layout()
    src, dst = pool(lay, 8, 1), pool(lay, 8, None)
    s, r = await rig.sender(lay, src), await rig.receiver(lay, dst)
    s.hooks.room_override[100] = 200
    s.create(100)
    results = await asyncio.gather(r.receive(100, [s.endpoint], [0, 1, 2]),
                                   s.send(100, [3, 4, 5], first_token=1, cached_tokens=0),
                                   return_exceptions=True)
    err = results[0]
    assert isinstance(err, TransferError)
    assert "bootstrap_room mismatch: expected 100, got 200" in str(err)
    assert (err.expected, err.actual, err.released_pages) == (100, 200, (0, 1, 2))
    assert bool((dst.float() == -7.0).all())  # not a single page written
    assert rig.released == [[0, 1, 2]] and r.stats["room_mismatches"] == 1
    assert r.poll(100) is TransferState.FAILED
    assert isinstance(results[1], TransferError)  # the prefill hears about it
    assert s.poll(100) is TransferState.FAILED
    # the next room on the same connection is unaffected
    s.create(101)
    await asyncio.gather(r.receive(101, [s.endpoint], [5, 6]),
                         s.send(101, [1, 2], first_token=1, cached_tokens=0))
    assert torch.equal(pages_of(dst, [5, 6]), pages_of(src, [1, 2]))


async def test_corrupted_page_fails_checksum(rig: Rig) -> None:
    lay = layout()
    src, dst = pool(lay, 8, 1), pool(lay, 8, None)
    s, r = await rig.sender(lay, src), await rig.receiver(lay, dst)
    s.hooks.corrupt_rooms.add(7)
    s.create(7)
    results = await asyncio.gather(r.receive(7, [s.endpoint], [0, 1]),
                                   s.send(7, [2, 3], first_token=1, cached_tokens=0),
                                   return_exceptions=True)
    assert isinstance(results[0], TransferError) and "checksum mismatch" in str(results[0])
    assert bool((dst.float() == -7.0).all())
    assert torch.equal(src, pool(lay, 8, 1))  # the hook corrupts a copy, never the source
    assert rig.released == [[0, 1]] and r.stats["checksum_failures"] == 1


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_abort_from_either_side(rig: Rig, side: str) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 8, 1)), await rig.receiver(lay, pool(lay, 8, None))
    s.create(3)
    rx = asyncio.create_task(r.receive(3, [s.endpoint], [0, 1]))
    await s.wait_bootstrapped(3)
    tx = asyncio.create_task(s.send(3, [0, 1], first_token=1, cached_tokens=0)) \
        if side == "decode" else None
    if side == "decode":
        r.abort(3, "client went away")
    else:
        s.abort(3, "out of memory")
    with pytest.raises(TransferError, match=f"aborted by the {side}"):
        await rx
    if tx is not None:
        with pytest.raises(TransferError, match="aborted by the decode"):
            await tx
    await asyncio.sleep(0.05)
    assert r.poll(3) is TransferState.FAILED and s.poll(3) is TransferState.FAILED
    assert rig.released == [[0, 1]]


async def test_bootstrap_timeout(rig: Rig) -> None:
    lay = layout()
    s = await rig.sender(lay, pool(lay, 4, 1), fast_config(bootstrap_timeout_s=0.3))
    s.create(12)
    with pytest.raises(TransferError, match="no decode rank asked for this room within 0.3 s"):
        await asyncio.wait_for(s.send(12, [0], first_token=1, cached_tokens=0), 5)
    assert s.poll(12) is TransferState.FAILED
    with pytest.raises(TransferError, match="new bootstrap_room"):
        s.create(12)


async def test_waiting_timeout(rig: Rig) -> None:
    lay = layout()
    s = await rig.sender(lay, pool(lay, 4, 1))
    r = await rig.receiver(lay, pool(lay, 4, None), fast_config(waiting_timeout_s=0.3))
    s.create(13)  # the prefill never computes the KV
    with pytest.raises(TransferError, match="no complete KV within 0.3 s") as info:
        await asyncio.wait_for(r.receive(13, [s.endpoint], [0, 1]), 5)
    assert info.value.stage is TransferState.WAITING_FOR_INPUT
    assert rig.released == [[0, 1]]


async def test_unreachable_prefill(rig: Rig) -> None:
    lay = layout()
    r = await rig.receiver(lay, pool(lay, 4, None), fast_config(connect_timeout_s=0.3))
    endpoint = "tcp://127.0.0.1:9" if rig.backend == "zmq" else "fake://nobody"
    with pytest.raises(TransferError, match="layout registration with prefill rank .* failed"):
        await asyncio.wait_for(r.receive(14, [endpoint], [0]), 5)
    assert rig.released == [[0]]


@pytest.mark.parametrize("over, text", [
    ({"page_size": 8}, "page_size: this side 4, peer 8"),
    ({"dtype": torch.float32}, "kv_cache_dtype: this side 'bfloat16', peer 'float32'"),
])
async def test_layout_mismatch_names_both_values(rig: Rig, over: dict, text: str) -> None:
    lay = layout()
    s = await rig.sender(lay, pool(lay, 4, 1))
    dlay = layout(**over)
    r = await rig.receiver(dlay, pool(dlay, 4, None))
    with pytest.raises(TransferError, match="KV layout mismatch") as info:
        await r.connect(s.endpoint)
    assert text in str(info.value)


async def test_page_count_mismatch(rig: Rig) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 8, 1)), await rig.receiver(lay, pool(lay, 8, None))
    s.create(15)
    results = await asyncio.gather(r.receive(15, [s.endpoint], [0, 1, 2]),
                                   s.send(15, [0, 1], first_token=1, cached_tokens=0),
                                   return_exceptions=True)
    assert all(isinstance(x, TransferError) for x in results)
    assert "reserved 3 pages but this prefill rank has 2" in str(results[1])


async def test_fail_peer_fails_in_flight_and_drops_connection(rig: Rig) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 8, 1)), await rig.receiver(lay, pool(lay, 8, None))
    s.create(21)
    s.create(22)
    t1 = asyncio.create_task(r.receive(21, [s.endpoint], [0]))
    t2 = asyncio.create_task(r.receive(22, [s.endpoint], [1, 2]))
    await s.wait_bootstrapped(21)
    await s.wait_bootstrapped(22)
    assert r.connected_peers() == [s.endpoint]
    assert sorted(r.fail_peer(s.endpoint, "2 heartbeats to /health missed")) == [21, 22]
    for t in (t1, t2):
        with pytest.raises(TransferError, match="declared dead: 2 heartbeats"):
            await t
    await asyncio.sleep(0.05)
    assert r.connected_peers() == []
    assert sorted(rig.released) == [[0], [1, 2]]
    # a fresh connection (and registration) is made for the next room
    s.create(23)
    await asyncio.gather(r.receive(23, [s.endpoint], [3]), s.send(23, [4], first_token=1,
                                                                  cached_tokens=0))
    assert r.connected_peers() == [s.endpoint]


async def test_large_buffers_travel_as_separate_zero_copy_frames(rig: Rig) -> None:
    """Buffers of 64 KiB and more are not packed: one frame per (layer, K/V), sent from the pool."""
    lay = layout(num_heads=8, head_dim=128, page_size=16, num_layers=2)
    src, dst = pool(lay, 6, seed=3), pool(lay, 6, seed=None)
    assert 2 * 16 * 8 * 128 * 2 >= 64 << 10  # two pages of one layer's K: 64 KiB
    s, r = await rig.sender(lay, src), await rig.receiver(lay, dst)
    s.create(60)
    res, _ = await asyncio.gather(r.receive(60, [s.endpoint], [4, 5]),
                                  s.send(60, [1, 2], first_token=1, cached_tokens=0))
    assert torch.equal(pages_of(dst, [4, 5]), pages_of(src, [1, 2]))
    assert res.bytes_received == 2 * lay.page_bytes()


async def test_unreachable_error_names_the_room(rig: Rig) -> None:
    lay = layout()
    r = await rig.receiver(lay, pool(lay, 4, None), fast_config(connect_timeout_s=0.2))
    endpoint = "tcp://127.0.0.1:9" if rig.backend == "zmq" else "fake://nobody"
    with pytest.raises(TransferError) as info:
        await r.receive(61, [endpoint], [0])
    assert info.value.room == 61 and info.value.stage is TransferState.BOOTSTRAPPING
    assert r.poll(61) is TransferState.FAILED


async def test_failing_page_source_fails_the_room_only(rig: Rig) -> None:
    lay = layout()
    src = pool(lay, 4, 1)
    s, r = await rig.sender(lay, src), await rig.receiver(lay, pool(lay, 4, None))
    s.create(62)
    results = await asyncio.gather(r.receive(62, [s.endpoint], [0]),
                                   s.send(62, [9], first_token=1, cached_tokens=0),  # no page 9
                                   return_exceptions=True)
    assert isinstance(results[1], TransferError) and "reading or encoding the pages failed" in str(
        results[1])
    assert isinstance(results[0], TransferError) and "aborted by the prefill" in str(results[0])
    s.create(63)  # the rank keeps serving
    await asyncio.gather(r.receive(63, [s.endpoint], [1]), s.send(63, [2], first_token=1,
                                                                 cached_tokens=0))


async def test_cancelled_receive_frees_pages_and_tells_the_prefill(rig: Rig) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 4, 1)), await rig.receiver(lay, pool(lay, 4, None))
    s.create(64)
    rx = asyncio.create_task(r.receive(64, [s.endpoint], [2, 3]))
    await s.wait_bootstrapped(64)
    rx.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rx
    assert rig.released == [[2, 3]] and r.poll(64) is TransferState.FAILED
    with pytest.raises(TransferError, match="aborted by the decode: the decode request was cancelled"):
        await asyncio.wait_for(s.send(64, [0, 1], first_token=1, cached_tokens=0), 5)


@pytest.mark.parametrize("backend", ["zmq"])
async def test_restarted_prefill_rank_is_registered_again(rig: Rig) -> None:
    lay = layout()
    src = pool(lay, 4, 1)
    s1 = await rig.sender(lay, src)
    dst = pool(lay, 4, None)
    r = await rig.receiver(lay, dst)
    s1.create(70)
    await asyncio.gather(r.receive(70, [s1.endpoint], [0]), s1.send(70, [1], first_token=1,
                                                                    cached_tokens=0))
    await s1.close()
    from transfer import TensorPageSource
    from transfer.backends.zmq_backend import ZmqSender
    s2 = ZmqSender(fast_config(), lay, TensorPageSource(src, lay), port=s1.rank_address[1])
    async def started() -> bool:
        try:
            await s2.start()
        except OSError:
            return False
        return True
    # ZMQ releases the closed socket's port from its I/O thread, a bit later.
    await wait_until(started, what="the new sender binds the old port", interval=0.1)
    rig.senders.append(s2)
    # A message ZMQ writes into the old connection before it notices the peer died is lost; the
    # decode's heartbeat is what finds the new process (as the PD heartbeat monitor does).
    for _ in range(50):
        if await r.ping(s2.endpoint, 0.2):
            break
    else:
        pytest.fail("the restarted prefill rank never answered a heartbeat")
    s2.create(71)
    with pytest.raises(TransferError, match="no layout registration"):
        await asyncio.wait_for(r.receive(71, [s2.endpoint], [1]), 5)
    s2.create(72)
    await asyncio.gather(r.receive(72, [s2.endpoint], [2]), s2.send(72, [3], first_token=1,
                                                                    cached_tokens=0))
    assert torch.equal(pages_of(dst, [2]), pages_of(src, [3]))


async def test_decode_abort_before_the_prefill_saw_the_room(rig: Rig) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 4, 1)), await rig.receiver(lay, pool(lay, 4, None))
    rx = asyncio.create_task(r.receive(80, [s.endpoint], [0]))
    await wait_until(lambda: r.poll(80) is TransferState.WAITING_FOR_INPUT,
                     what="room 80 waits for its input at the prefill", detail=lambda: r.poll(80))
    r.abort(80, "client disconnected")
    with pytest.raises(TransferError):
        await rx
    # The prefill rank keeps the abort of a room it has not seen (its early table; no public
    # view of it): the late create below must find it there.
    await wait_until(lambda: 80 in s._early._aborts,  # type: ignore[attr-defined]
                     what="the prefill rank holds the decode's abort of room 80")
    s.create(80)  # the prefill's copy of the request arrives late
    assert s.poll(80) is TransferState.FAILED
    with pytest.raises(TransferError, match="aborted by the decode: client disconnected"):
        await s.send(80, [1], first_token=1, cached_tokens=0)


async def test_layout_registered_once_per_connection(rig: Rig) -> None:
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 8, 1)), await rig.receiver(lay, pool(lay, 8, None))
    for room in (90, 91, 92):
        s.create(room)
        await asyncio.gather(r.receive(room, [s.endpoint], [room - 90]),
                             s.send(room, [room - 88], first_token=1, cached_tokens=0))
    assert s.stats["registrations"] == 1 and r.stats["registrations"] == 1
    assert s.stats["rooms_ok"] == 3 and r.stats["rooms_ok"] == 3
    assert r.stats["bytes_received"] == s.stats["bytes_sent"] == 3 * lay.page_bytes()
    assert list(s.registered_peers().values()) == [lay]


async def test_port_in_use_is_a_clear_error() -> None:
    from transfer import TensorPageSource
    from transfer.backends.zmq_backend import ZmqSender

    lay = layout()
    a = ZmqSender(fast_config(), lay, TensorPageSource(pool(lay, 2, 1), lay))
    await a.start()
    try:
        b = ZmqSender(fast_config(), lay, TensorPageSource(pool(lay, 2, 1), lay), port=a.port)
        with pytest.raises(OSError, match=f"cannot bind the KV sender at tcp://127.0.0.1:{a.port}"):
            await b.start()
    finally:
        await a.close()
