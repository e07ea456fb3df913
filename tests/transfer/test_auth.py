"""Transfer authentication: a MAC with a shared key (transfer.auth) on every data-plane message.

A process without the key must not be able to deliver KV, register, or abort a room; a captured
message must not verify for another room or the other direction."""
from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from transfer_helpers import Rig, fast_config, layout, pages_of, pool

from transfer import TensorPageSource, TransferConfig, TransferError, TransferState, wire
from transfer.auth import D2P, P2D, TransferAuth

pytestmark = pytest.mark.timeout(30)
KEY = "k" * 16 + "-shared-transfer-key"
OTHER = "o" * 16 + "-another-cluster-key"


def keyed(key: str | None = KEY) -> TransferConfig:
    # A refused decode never asks for the room: the prefill's send ends at the bootstrap timeout.
    return fast_config(key=key, bootstrap_timeout_s=2.0)


def pages_msg(room: int, data: bytes = b"\x01" * 64) -> wire.Pages:
    return wire.Pages(transfer_id=1, room=room, page_start=0, page_count=1, layers=(0, 1),
                      heads=(0, 1), dtype="bfloat16", shape=(1, 1, 1, 32), checksum=0,
                      checksum_algo="poly1305", buffers=(data, data))


def test_mac_binds_header_payload_direction_and_key() -> None:
    a = TransferAuth(KEY)
    frames = wire.encode(pages_msg(5), a, P2D)
    assert len(frames) == 4 and len(frames[-1]) == 16
    assert wire.decode(frames, a, P2D).room == 5
    # another room: rewriting the header's room (a captured message replayed for room 6)
    head = msgpack.unpackb(frames[0])
    head["room"] = 6
    with pytest.raises(wire.AuthError, match="failed its MAC check"):
        wire.decode([msgpack.packb(head), *frames[1:]], a, P2D)
    # one payload byte changed
    with pytest.raises(wire.AuthError, match="failed its MAC check"):
        wire.decode([frames[0], b"\x02" + b"\x01" * 63, *frames[2:]], a, P2D)
    # reflected back to the sender (the other direction) or checked with another key
    with pytest.raises(wire.AuthError, match="failed its MAC check"):
        wire.decode(frames, a, D2P)
    with pytest.raises(wire.AuthError, match="failed its MAC check"):
        wire.decode(frames, TransferAuth(OTHER), P2D)
    # without the key: refused either way round, naming the variable to set
    with pytest.raises(wire.AuthError, match="KVATLAS_TRANSFER_KEY"):
        wire.decode(frames, None, P2D)
    with pytest.raises(wire.AuthError, match="not authenticated.*KVATLAS_TRANSFER_KEY"):
        wire.decode(wire.encode(wire.Ack(transfer_id=1, room=5)), a, P2D)
    # every message gets a fresh nonce: the same message never repeats a one-time key
    again = wire.encode(pages_msg(5), a, P2D)
    assert again[0] != frames[0] and again[-1] != frames[-1]


def test_key_validation_names_the_variable() -> None:
    with pytest.raises(ValueError, match="KVATLAS_TRANSFER_KEY.*at least 16"):
        keyed("short")
    assert KEY not in repr(keyed())  # never in a logged config


async def transfer(rig: Rig, s_key: str | None, r_key: str | None, room: int = 11):
    lay = layout()
    src, dst = pool(lay, 8, 1), pool(lay, 8, None)
    s = await rig.sender(lay, src, keyed(s_key))
    r = await rig.receiver(lay, dst, keyed(r_key))
    s.create(room)
    res = await asyncio.gather(r.receive(room, [s.endpoint], [0, 1, 2]),
                               s.send(room, [3, 4, 5], first_token=1, cached_tokens=0),
                               return_exceptions=True)
    return s, r, src, dst, res


async def test_keyed_transfer_round_trip(rig: Rig) -> None:
    s, r, src, dst, (res, sent) = await transfer(rig, KEY, KEY)
    assert sent is None and res.num_pages == 3
    assert torch.equal(pages_of(dst, [0, 1, 2]), pages_of(src, [3, 4, 5]))
    assert s.stats["auth_failures"] == r.stats["auth_failures"] == 0


@pytest.mark.parametrize("s_key, r_key", [(KEY, None), (None, KEY), (KEY, OTHER)])
async def test_without_the_key_nothing_registers(rig: Rig, s_key, r_key) -> None:
    s, r, _, dst, (err, _) = await transfer(rig, s_key, r_key)
    assert isinstance(err, TransferError)
    assert "authentication" in str(err) and "KVATLAS_TRANSFER_KEY" in str(err)
    assert s.registered_peers() == {}
    assert bool((dst.float() == -7.0).all()) and rig.released == [[0, 1, 2]]


async def test_a_forged_rank_cannot_deliver_kv(rig: Rig) -> None:
    """The decode resolved a rank that an attacker registered (e.g. a forged PUT /route): the
    attacker's sender runs the real protocol, but without the key its KV never reaches the pool."""
    lay = layout()
    forged = await rig.sender(lay, pool(lay, 8, 99), keyed(None))
    dst = pool(lay, 8, None)
    r = await rig.receiver(lay, dst, keyed())
    forged.create(12)
    err, _ = await asyncio.gather(r.receive(12, [forged.endpoint], [0, 1]),
                                  forged.send(12, [0, 1], first_token=666, cached_tokens=0),
                                  return_exceptions=True)
    assert isinstance(err, TransferError) and "authentication" in str(err)
    assert bool((dst.float() == -7.0).all()) and r.stats["auth_failures"] >= 1


@pytest.mark.parametrize("backend", ["zmq"])
async def test_unkeyed_abort_and_request_are_ignored(rig: Rig) -> None:
    """A peer without the key that reaches the prefill's port (a raw ZMQ socket speaking the wire
    format) can neither abort a room in flight nor ask for it."""
    lay = layout()
    s = await rig.sender(lay, pool(lay, 8, 1), keyed())
    good = await rig.receiver(lay, pool(lay, 8, None), keyed())
    s.create(21)
    rx = asyncio.create_task(good.receive(21, [s.endpoint], [0, 1]))
    await s.wait_bootstrapped(21)
    attacker = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(s.endpoint)
    try:
        for msg in (wire.Abort(room=21, transfer_id=None, reason="forged"),
                    wire.Request(transfer_id=1, room=21, dst_rank=0, num_requesters=1,
                                 dst_page_ids=(0, 1))):
            await attacker.send_multipart(wire.encode(msg))
        while s.stats["auth_failures"] < 2:
            await asyncio.sleep(0.01)
    finally:
        attacker.close(linger=0)
    assert s.poll(21) is TransferState.WAITING_FOR_INPUT
    await s.send(21, [2, 3], first_token=1, cached_tokens=0)
    assert (await rx).num_pages == 2


def test_start_up_warns_without_a_key(caplog: pytest.LogCaptureFixture) -> None:
    async def start() -> None:
        rig = Rig("zmq")
        lay = layout()
        await rig.sender(lay, pool(lay, 2, 1))
        await rig.receiver(lay, pool(lay, 2, None))
        await rig.sender(lay, pool(lay, 2, 1), keyed())
        await rig.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(start())
    warned = [r.getMessage() for r in caplog.records if "without transfer authentication" in
              r.getMessage()]
    assert len(warned) == 2 and all("KVATLAS_TRANSFER_KEY" in m for m in warned)


def test_mac_binds_where_each_frame_ends() -> None:
    """Moving bytes from one frame to the next keeps the concatenation (and so a MAC over it
    alone) unchanged; the MAC must cover each frame's length and their count."""
    a = TransferAuth(KEY)
    k, v = b"\x01" * 64, b"\x02" * 64
    frames = wire.encode(wire.Pages(**{**pages_msg(5).__dict__, "buffers": (k, v)}), a, P2D)
    head, tag = frames[0], frames[-1]
    for resplit in ([k + v[:2], v[2:]], [k[:-2], k[-2:] + v], [k, v, b""], [k + v]):
        assert b"".join(resplit) == k + v
        assert not a.verify(P2D, head, resplit, tag)
        with pytest.raises(wire.AuthError, match="failed its MAC check"):
            wire.decode([head, *resplit, tag], a, P2D)
    assert a.verify(P2D, head, [k, v], tag)


def test_a_keyless_peer_cannot_make_the_keyed_side_build_its_header() -> None:
    """The MAC is checked on the raw frames, before msgpack builds anything: a 2 MB header of
    one-byte ints would otherwise become a 2M-entry tuple (16 MB) before being refused."""
    import tracemalloc

    n = 2_000_000
    bomb = msgpack.packb({"v": wire.WIRE_VERSION, "kind": "request", "auth": "poly1305",
                          "n": b"\x00" * 16, "dst_page_ids": [0] * n})
    assert len(bomb) < n + 100
    frames = [bomb, b"\x00" * 16]
    tracemalloc.start()
    try:
        with pytest.raises(wire.AuthError, match="failed its MAC check"):
            wire.decode(frames, TransferAuth(KEY), D2P)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing a forged message allocated {peak} bytes"
    # small forged headers are still parsed to name the failure (and a version mismatch)
    with pytest.raises(wire.WireError, match="v7"):
        wire.decode([msgpack.packb({"v": 7, "kind": "ack"}), b"\x00" * 16], TransferAuth(KEY), D2P)


@pytest.mark.parametrize("backend", ["zmq"])
async def test_corrupt_hook_leaves_the_mac_of_a_header_only_chunk_alone(rig: Rig) -> None:
    """A CUDA IPC chunk is a header (the handles) and, with a key, the MAC: the corrupt-chunk hook
    must not flip the MAC's first byte and turn a checksum test into an authentication failure.
    No GPU here, so a sender that sends header-only chunks the way ``CudaIpcSender`` does; a
    host-pool receiver refuses their payload, which is the failure the test expects to see."""
    from transfer.backends.zmq_backend import ZmqSender

    class HeaderOnly(ZmqSender):
        def _encode_payload(self, reg, tensors):
            return ({"checksum": 1, "checksum_algo": "dsum64", "payload": "cuda_ipc",
                     "ipc": [[0]] * len(tensors)}, [], tensors)

    lay = layout()
    s = HeaderOnly(keyed(), lay, TensorPageSource(pool(lay, 8, 1), lay))
    await s.start()
    rig.senders.append(s)
    r = await rig.receiver(lay, pool(lay, 8, None), keyed())
    s.create(31)
    s.hooks.corrupt_rooms.add(31)
    err, _ = await asyncio.gather(r.receive(31, [s.endpoint], [0, 1]),
                                  s.send(31, [2, 3], first_token=1, cached_tokens=0),
                                  return_exceptions=True)
    assert isinstance(err, TransferError) and "payload 'cuda_ipc' is not supported" in str(err)
    assert r.stats["auth_failures"] == 0
