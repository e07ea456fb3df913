"""Wire format: round trips of every kind, versioning, bad input, zero-copy tensor views."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import wire
from transfer.layout import KVLayout, bytes_tensor, tensor_bytes

V = wire.WIRE_VERSION
u64 = st.integers(1, 2 ** 64 - 1)
small = st.integers(0, 2 ** 31)
text = st.text(max_size=40)


@st.composite
def layouts(draw) -> KVLayout:
    tp = draw(st.sampled_from([1, 2, 4]))
    return KVLayout.for_tp(num_layers=draw(st.integers(1, 64)), num_heads=4 * draw(st.integers(1, 4)),
                           head_dim=draw(st.sampled_from([64, 128])),
                           page_size=draw(st.sampled_from([1, 16, 64])),
                           dtype=draw(st.sampled_from(["bfloat16", "float32", "float64"])),
                           tp_rank=draw(st.integers(0, tp - 1)), tp_size=tp)


@st.composite
def pages_msgs(draw) -> wire.Pages:
    l0 = draw(st.integers(0, 4))
    nl = draw(st.integers(1, 3))
    bufs = tuple(draw(st.binary(min_size=0, max_size=64)) for _ in range(2 * nl))
    return wire.Pages(transfer_id=draw(small), room=draw(u64), page_start=draw(small),
                      page_count=draw(st.integers(1, 1000)), layers=(l0, l0 + nl),
                      heads=(0, draw(st.integers(1, 8))), dtype="bfloat16",
                      shape=(1, 16, 2, 128), checksum=wire.checksum(bufs), buffers=bufs)


messages = st.one_of(
    st.builds(wire.Register, receiver_id=text, layout=layouts(), num_pages=st.integers(1, 2 ** 31),
              max_chunk_bytes=st.integers(4096, 2 ** 31), host_id=text,
              device=st.sampled_from(["cpu", "cuda:0"])),
    st.builds(wire.RegisterAck, ok=st.booleans(), layout=st.one_of(st.none(), layouts()), error=text),
    st.builds(wire.Request, transfer_id=small, room=u64, dst_rank=st.integers(0, 7),
              num_requesters=st.integers(1, 8),
              dst_page_ids=st.lists(small, max_size=50).map(tuple)),
    pages_msgs(),
    st.builds(wire.Final, transfer_id=small, room=u64, first_token=small, cached_tokens=small,
              num_pages=small, num_chunks=small),
    st.builds(wire.Ack, transfer_id=small, room=u64),
    st.builds(wire.Abort, room=u64, transfer_id=st.one_of(st.none(), small), reason=text),
    st.builds(wire.Heartbeat, seq=small, reply=st.booleans()),
)


@settings(max_examples=300)
@given(messages)
def test_round_trip(msg: wire.Message) -> None:
    frames = wire.encode(msg)
    # as a ZMQ receiver sees them: read-only memoryviews
    back = wire.decode([memoryview(bytes(f)) for f in frames])
    assert type(back) is type(msg)
    assert back == msg
    if isinstance(msg, wire.Pages):
        assert [bytes(b) for b in back.buffers] == [bytes(b) for b in msg.buffers]
        assert wire.checksum(back.buffers) == msg.checksum


def test_header_is_self_describing() -> None:
    frames = wire.encode(wire.Ack(transfer_id=3, room=99))
    head = msgpack.unpackb(frames[0])
    assert head == {"v": wire.WIRE_VERSION, "kind": "ack", "transfer_id": 3, "room": 99}


def test_version_mismatch_names_both() -> None:
    raw = msgpack.packb({"v": 7, "kind": "ack", "transfer_id": 1, "room": 1})
    with pytest.raises(wire.WireError, match=rf"v{wire.WIRE_VERSION}.*v7"):
        wire.decode([raw])


def test_missing_field_named_and_unknown_ignored() -> None:
    with pytest.raises(wire.WireError, match="'room'"):
        wire.decode([msgpack.packb({"v": V, "kind": "ack", "transfer_id": 1})])
    msg = wire.decode([msgpack.packb({"v": V, "kind": "ack", "transfer_id": 1, "room": 2,
                                      "added_in_v1_1": [1, 2]})])
    assert msg == wire.Ack(transfer_id=1, room=2)


@pytest.mark.parametrize("frames, word", [
    ([], "empty"),
    ([b"\xc1"], "msgpack"),
    ([msgpack.packb([1, 2])], "map"),
    ([msgpack.packb({"v": V, "kind": "nope"})], "unknown message kind"),
    ([msgpack.packb({"v": V, "kind": "ack", "transfer_id": 1, "room": 2}), b"x"], "unexpected"),
])
def test_bad_input(frames: list, word: str) -> None:
    with pytest.raises(wire.WireError, match=word):
        wire.decode(frames)


def test_pages_buffer_count_checked() -> None:
    msg = wire.Pages(transfer_id=1, room=1, page_start=0, page_count=1, layers=(0, 2), heads=(0, 1),
                     dtype="bfloat16", shape=(1, 1, 1, 1), checksum=0, buffers=(b"a", b"b", b"c"))
    with pytest.raises(wire.WireError, match="needs 4 buffers"):
        wire.decode(wire.encode(msg))


def test_checksum_is_xxh3_over_the_exact_bytes() -> None:
    parts = [b"abc", memoryview(b"defgh"), bytearray(b"")]
    assert wire.checksum(parts) == xxhash.xxh3_64(b"abcdefgh").intdigest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_tensor_bytes_zero_copy_round_trip(dtype: torch.dtype) -> None:
    t = torch.randn(3, 4, 5, dtype=torch.float64).to(dtype)
    view = tensor_bytes(t)
    assert view.nbytes == t.numel() * t.element_size()
    # shares storage: a change to the tensor shows in the view
    before = bytes(view[:t.element_size()])
    t.view(-1)[0] = 3.0 if float(t.view(-1)[0]) != 3.0 else 5.0
    assert bytes(view[:t.element_size()]) != before
    back = bytes_tensor(memoryview(bytes(view)), dtype, (3, 4, 5))
    assert torch.equal(back, t)
    # a read-only received frame is viewed without a copy
    frame = np.frombuffer(bytes(view), dtype=np.uint8)
    assert bytes_tensor(frame, dtype, (3, 4, 5)).data_ptr() == frame.ctypes.data


def test_tensor_bytes_rejects_non_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.zeros(4, 4).t())


def test_packed_pages_split_back_into_buffers() -> None:
    bufs = [bytes([i]) * 6 for i in range(4)]
    msg = wire.Pages(transfer_id=1, room=2, page_start=0, page_count=1, layers=(0, 2), heads=(0, 1),
                     dtype="bfloat16", shape=(1, 1, 1, 3), checksum=wire.checksum(bufs),
                     packed=True, buffers=[wire.pack(bufs)])
    frames = wire.encode(msg)
    assert len(frames) == 2
    back = wire.decode(frames)
    assert [bytes(b) for b in back.buffers] == bufs
    assert wire.checksum(back.buffers) == msg.checksum  # packing does not change the bytes
    with pytest.raises(wire.WireError, match="does not split into 4"):
        wire.decode([frames[0], b"12345"])
    with pytest.raises(wire.WireError, match="exactly one frame"):
        wire.decode([frames[0], b"1234", b"5678"])
