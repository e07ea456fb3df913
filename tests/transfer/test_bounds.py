"""Transfer sockets are bounded: message size (zmq.MAXMSGSIZE, from the layout), the prefill's
table of requests for rooms not started (count; entries hold no page ids), and page ids checked
against both pools before anything is stored."""
from __future__ import annotations

import asyncio

import pytest
import zmq
from transfer_helpers import Rig, fast_config, layout, pool
from waiting import wait_until

from transfer import TransferError, wire
from transfer.backends.zmq_backend import ZmqReceiver, ZmqSender

pytestmark = pytest.mark.timeout(30)


async def pair(rig: Rig, *, prefill_pages: int = 8, decode_pages: int = 8, **over: object):
    lay = layout()
    s = await rig.sender(lay, pool(lay, prefill_pages, 1), fast_config(**over))
    r = await rig.receiver(lay, pool(lay, decode_pages, None), fast_config(**over))
    await r.connect(s.endpoint)
    return s, r


async def raw_request(r, s, room: int, ids: tuple[int, ...]) -> None:
    """A request as a (buggy or hostile) registered decode may send it: any ids, no receive()."""
    await r._send_frames(s.endpoint, r._encode(wire.Request(
        transfer_id=10_000 + room, room=room, dst_rank=0, num_requesters=1, dst_page_ids=ids)))


@pytest.mark.parametrize("ids, word", [
    ((0, 8), "within [0, 8) (the decode's pool)"),        # id outside the decode's pool
    ((1, 1), "distinct"),                                   # the same page twice
    (tuple(range(5)), "at most 4 pages (its pool)"),        # more than this prefill rank holds
])
async def test_bad_page_ids_are_refused_before_anything_is_stored(rig: Rig, ids, word) -> None:
    s, r = await pair(rig, prefill_pages=4)
    await raw_request(r, s, 900, ids)
    await wait_until(lambda: s.stats["refused"] == 1, what="the prefill refuses the request")
    assert len(s._early) == 0 and s.poll(900) is None


async def test_early_requests_keep_no_page_ids_and_are_capped(rig: Rig) -> None:
    s, r = await pair(rig, prefill_pages=64, decode_pages=64, max_early_requests=3)
    await raw_request(r, s, 1, tuple(range(64)))
    await wait_until(lambda: len(s._early) == 1, what="the prefill holds 1 early request")
    [kept], _ = s._early.pop(1)
    assert kept.request.dst_page_ids == () and kept.num_pages == 64
    # three rooms fit; the decode asking for a fourth hears at once why it will get nothing
    fits = [asyncio.create_task(r.receive(room, [s.endpoint], [room])) for room in (2, 3, 4)]
    await wait_until(lambda: len(s._early) == 3, what="the prefill holds 3 early requests")
    with pytest.raises(TransferError, match="already holds 3 requests and aborts.*max_early"):
        await r.receive(5, [s.endpoint], [5])
    for room in (2, 3, 4):  # the kept ones are served normally once the prefill admits them
        s.create(room)
        await s.send(room, [room], first_token=1, cached_tokens=0)
    await asyncio.gather(*fits)
    assert len(s._early) == 0


async def test_aborts_for_unknown_rooms_count_against_the_cap(rig: Rig) -> None:
    s, r = await pair(rig, max_early_requests=2)
    for room in range(100, 110):
        await r._send_frames(s.endpoint, r._encode(wire.Abort(room=room, transfer_id=None,
                                                              reason="x" * 10_000)))
    await r.ping(s.endpoint, 5)  # the connection is ordered: every abort was handled by now
    assert len(s._early) == 2
    _, kept = s._early.pop(100)
    assert kept is not None and len(kept.reason) <= 256


@pytest.mark.parametrize("backend", ["zmq"])
async def test_sockets_refuse_frames_larger_than_the_layout_allows(rig: Rig) -> None:
    s, r = await pair(rig, prefill_pages=16, decode_pages=8, chunk_bytes=8192)
    assert isinstance(s, ZmqSender) and isinstance(r, ZmqReceiver)
    assert s._sock.getsockopt(zmq.MAXMSGSIZE) == wire.max_request_message_bytes(16)
    assert r._socks[s.endpoint].getsockopt(zmq.MAXMSGSIZE) == \
        wire.max_pages_message_bytes(layout(), 8192) == 8192 + wire.HEADER_ROOM


async def test_the_decode_chunk_limit_is_honoured_by_a_bigger_sender(rig: Rig) -> None:
    """The decode's socket accepts chunks up to its own chunk_bytes: a prefill configured with
    larger chunks cuts them to the decode's size (sent in register), rather than being cut off."""
    lay = layout()
    src, dst = pool(lay, 12, 6), pool(lay, 12, None)
    s = await rig.sender(lay, src, fast_config(chunk_bytes=1 << 20))
    r = await rig.receiver(lay, dst, fast_config(chunk_bytes=4096))
    s.create(7)
    res, _ = await asyncio.gather(r.receive(7, [s.endpoint], list(range(10))),
                                  s.send(7, list(range(10)), first_token=1, cached_tokens=0))
    assert res.chunks == 6  # 4096-byte chunks (see test_many_chunks), not one 1 MiB chunk


@pytest.mark.parametrize("backend", ["zmq"])
async def test_a_decode_connection_queues_a_few_chunks_not_a_whole_transfer(rig: Rig) -> None:
    """ZMQ's default receive HWM (1000 messages) let one connection queue up to 1000 chunk-sized
    frames before the receiver looked at them; past a few chunks, ZMQ must stop reading TCP."""
    s, r = await pair(rig)
    sock = r._socks[s.endpoint]
    hwm, biggest = sock.getsockopt(zmq.RCVHWM), sock.getsockopt(zmq.MAXMSGSIZE)
    assert 0 < hwm <= 16 and hwm * biggest <= 16 * (r.config.chunk_bytes + wire.HEADER_ROOM)


async def test_a_started_room_keeps_no_page_ids_either(rig: Rig) -> None:
    """Like the early table, a live room's destinations keep only the page count: a request may
    carry as many ids as the pool has pages, for every room in flight."""
    s, r = await pair(rig, prefill_pages=64, decode_pages=64)
    s.create(40)
    rx = asyncio.create_task(r.receive(40, [s.endpoint], list(range(64))))
    await s.wait_bootstrapped(40)
    [dest] = s._rooms[40].dests.values()
    assert dest.request.dst_page_ids == () and dest.num_pages == 64
    await s.send(40, list(range(64)), first_token=1, cached_tokens=0)
    assert (await rx).num_pages == 64
