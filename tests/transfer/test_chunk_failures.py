"""A chunk k > 0 that fails (corrupt, another room), with one or several prefill ranks.

What holds (docs/security.md, ``_receiver_core``): every chunk is checked (MAC, room, box,
checksum) before any byte of it is written; chunks are written as they pass, so a failure at
chunk k > 0 leaves earlier chunks in the room's own reserved pages, which are released
uncommitted; no page outside the reservation is ever written."""
from __future__ import annotations

import asyncio

import pytest
from transfer_helpers import Rig, fast_config, layout, pages_of, pool

from transfer import TransferError, TransferState, wire

pytestmark = pytest.mark.timeout(30)
KEY = "chunk-tests-transfer-key-0123456789"
DST = [9, 2, 7, 4, 11, 0, 5, 3, 8, 1]   # the reservation
OUTSIDE = [6, 10]                        # pages of the decode pool nobody may touch
# 3 layers x 10 pages of 512 bytes: with 4096-byte chunks, 8 + 2 pages per layer, 6 chunks.
CHUNKED = dict(chunk_bytes=4096)


def configs(key: str | None):
    return fast_config(**CHUNKED) if key is None else fast_config(key=key, **CHUNKED)


def check_failed(err: object, rig: Rig, dst, r, s_list, room: int) -> TransferError:
    assert isinstance(err, TransferError), err
    assert err.stage is TransferState.TRANSFERRING
    assert err.released_pages == tuple(DST) and rig.released == [DST]
    assert bool((pages_of(dst, OUTSIDE).float() == -7.0).all())
    assert r.poll(room) is TransferState.FAILED
    assert all(s.poll(room) is TransferState.FAILED for s in s_list)
    return err


async def one_pair(rig: Rig, config, room: int, *, from_chunk: int, corrupt: bool = False,
                   wire_room: int | None = None):
    """One prefill and one decode rank; the prefill's chunks from ``from_chunk`` on are corrupted
    in flight or carry ``wire_room``. Returns the pair, the pools and the checked error."""
    lay = layout()
    src, dst = pool(lay, 12, room), pool(lay, 12, None)
    s, r = await rig.sender(lay, src, config), await rig.receiver(lay, dst, config)
    if corrupt:
        s.hooks.corrupt_rooms.add(room)
    if wire_room is not None:
        s.hooks.room_override[room] = wire_room
    s.hooks.from_chunk = from_chunk
    s.create(room)
    err, _ = await asyncio.gather(r.receive(room, [s.endpoint], DST),
                                  s.send(room, list(range(10)), first_token=1, cached_tokens=0),
                                  return_exceptions=True)
    return s, r, src, dst, check_failed(err, rig, dst, r, [s], room)


@pytest.mark.parametrize("key", [None, KEY])
async def test_corrupt_chunk_after_the_first(rig: Rig, key: str | None) -> None:
    s, r, src, dst, err = await one_pair(rig, configs(key), 50, from_chunk=2, corrupt=True)
    if key is None:
        assert "checksum mismatch in chunk 2 (pages [0, 8) of layers [1, 2))" in str(err)
        assert r.stats["checksum_failures"] == 1
    else:  # the MAC is the chunk's integrity check: the altered chunk fails authentication
        assert "pages message from this prefill rank failed authentication" in str(err)
        assert r.stats["auth_failures"] >= 1  # chunks already in flight fail theirs too
    # the connection stays usable: the next room goes through intact
    s.hooks.corrupt_rooms.clear()
    s.create(51)
    await asyncio.gather(r.receive(51, [s.endpoint], [6, 10]),
                         s.send(51, [0, 1], first_token=1, cached_tokens=0))
    assert pages_of(dst, [6, 10]).equal(pages_of(src, [0, 1]))


async def test_wrong_room_in_a_later_chunk(rig: Rig) -> None:
    s, r, src, dst, err = await one_pair(rig, configs(None), 60, from_chunk=3, wire_room=61)
    assert "bootstrap_room mismatch: expected 60, got 61 in chunk 3" in str(err)
    # chunks 0-2 may already be in the reservation, so the error must not claim otherwise
    assert "nothing was written" not in str(err)
    assert "reserved pages are released uncommitted" in str(err)
    assert (err.expected, err.actual) == (60, 61) and r.stats["room_mismatches"] == 1


@pytest.mark.parametrize("fault", ["corrupt", "room"])
async def test_later_chunk_of_one_of_two_prefill_ranks(rig: Rig, fault: str) -> None:
    """Decode TP 1 < prefill TP 2: rank 1's chunk 1 fails after both ranks' first chunks passed."""
    g = pool(layout(), 12, 5)
    senders = []
    for rank in range(2):
        lay = layout(rank, 2)
        senders.append(await rig.sender(lay, g[:, :, :, :, lay.heads[0]:lay.heads[1]].contiguous(),
                                        fast_config(**CHUNKED)))
    bad = senders[1]
    if fault == "corrupt":
        bad.hooks.corrupt_rooms.add(70)
    else:
        bad.hooks.room_override[70] = 71
    bad.hooks.from_chunk = 1
    dst = pool(layout(), 12, None)
    r = await rig.receiver(layout(), dst, fast_config(**CHUNKED))
    for s in senders:
        s.create(70)
    results = await asyncio.gather(r.receive(70, [s.endpoint for s in senders], DST),
                                   *(s.send(70, list(range(10)), first_token=1, cached_tokens=0)
                                     for s in senders), return_exceptions=True)
    err = check_failed(results[0], rig, dst, r, senders, 70)
    assert err.peer == bad.endpoint
    assert ("checksum mismatch in chunk 1" if fault == "corrupt"
            else "bootstrap_room mismatch: expected 70, got 71 in chunk 1") in str(err)


@pytest.mark.parametrize("key", [None, KEY])
async def test_an_undecodable_chunk_fails_its_room_at_once(rig: Rig, key: str | None) -> None:
    """A chunk from the room's own prefill rank with a field of the wrong type (here a string page
    start, which used to raise TypeError outside the receiver's error handling) fails the room
    and releases its pages now, not when the waiting timeout fires."""
    lay = layout()
    config = fast_config(key=key, waiting_timeout_s=20.0)
    s = await rig.sender(lay, pool(lay, 8, 1), config)
    dst = pool(lay, 8, None)
    r = await rig.receiver(lay, dst, config)
    s.create(77)
    rx = asyncio.create_task(r.receive(77, [s.endpoint], [0, 1]))
    await s.wait_bootstrapped(77)
    [dest] = s._rooms[77].dests.values()
    data = b"\x00" * (lay.page_bytes((0, 1)) // 2)
    bad = wire.Pages(transfer_id=dest.request.transfer_id, room=77, page_start="0", page_count=1,
                     layers=(0, 1), heads=lay.heads, dtype=lay.dtype,
                     shape=(1, lay.page_size, lay.local_heads, lay.head_dim), checksum=0,
                     buffers=(data, data))
    await s._send_frames(dest.reg.conn, s._encode(bad))
    with pytest.raises(TransferError, match="could not be decoded.*wrong type: page_start"):
        await asyncio.wait_for(rx, 5)
    assert rig.released == [[0, 1]] and bool((dst.float() == -7.0).all())
