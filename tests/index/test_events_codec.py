"""The KV-event wire codec: both encodings round-trip, foreign shapes decode, bad input is refused
with a MalformedEvent (never another exception type)."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index.events.codec import DecodeLimits, decode_message, decode_payload, encode_message, encode_payload
from index.events.errors import MalformedEvent
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

U64 = st.integers(0, 2**64 - 1)
OPT_STR = st.none() | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "disk"])


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    bs = draw(st.integers(1, 8))
    n = draw(st.integers(0, 4))
    return BlockStored(
        block_hashes=draw(st.lists(U64, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | U64),
        token_ids=draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        lora_id=draw(st.none() | st.integers(0, 1000)),
        medium=draw(OPT_STR),
        lora_name=draw(st.none() | st.text(max_size=8)),
    )


EVENTS = st.one_of(
    stored(),
    st.builds(BlockRemoved, st.lists(U64, max_size=5), OPT_STR),
    st.just(AllBlocksCleared()),
)
BATCHES = st.builds(KVEventBatch, st.floats(0, 2e9, allow_nan=False), st.lists(EVENTS, max_size=6),
                    st.none() | st.integers(0, 64))


@settings(max_examples=200, deadline=None)
@given(BATCHES, st.sampled_from(["map", "array"]), st.binary(max_size=12), st.integers(0, 2**64 - 1))
def test_round_trip_both_encodings(batch: KVEventBatch, encoding: str, topic: bytes, seq: int) -> None:
    frames = encode_message(topic, seq, batch, encoding)  # type: ignore[arg-type]
    assert decode_message(frames) == (topic, seq, batch)


def test_map_and_array_encodings_differ_on_the_wire() -> None:
    batch = KVEventBatch(1.0, [BlockStored([1], None, [1, 2], 2), BlockRemoved([1]), AllBlocksCleared()])
    as_map = msgpack.unpackb(encode_payload(batch, "map"))
    as_array = msgpack.unpackb(encode_payload(batch, "array"))
    assert as_map[1][0] == {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                            "token_ids": [1, 2], "block_size": 2}
    assert as_array[1][0] == ["BlockStored", [1], None, [1, 2], 2]
    assert as_map[1][1] == {"type": "BlockRemoved", "block_hashes": [1]}
    assert as_array[1][2] == ["AllBlocksCleared"]


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_foreign_shapes() -> None:
    """Two-element batch, SGLang's array batch of map events with extra keys, trailing defaulted
    fields missing, extra trailing array fields, signed/unsigned/bytes hashes."""
    neg = -5
    events = [
        {"type": "BlockStored", "block_hashes": [neg, 2**64 - 1, b"\x00" * 24 + (7).to_bytes(8, "big")],
         "parent_block_hash": -1, "token_ids": list(range(6)), "block_size": 2,
         "medium": "GPU", "extra_keys": [[1, "x"]], "future_field": {"a": 1}},
        ["BlockStored", [3], None, [9, 9], 2],
        ["BlockStored", [4], 3, [9, 9], 2, 7, "CPU", "lora-a", None, "more", 1],
        ["BlockRemoved", [b"\xff" * 8]],
        {"type": "AllBlocksCleared", "whatever": 1},
    ]
    batch = decode_payload(pack([12.5, events]))
    assert batch.data_parallel_rank is None
    e0, e1, e2, e3, e4 = batch.events
    assert e0 == BlockStored([2**64 - 5, 2**64 - 1, 7], 2**64 - 1, list(range(6)), 2, None, "GPU", None,
                             [[1, "x"]])
    assert e1 == BlockStored([3], None, [9, 9], 2)
    assert e2 == BlockStored([4], 3, [9, 9], 2, 7, "CPU", "lora-a")
    assert e3 == BlockRemoved([2**64 - 1])
    assert e4 == AllBlocksCleared()
    # A batch sent as a map is accepted too.
    assert decode_payload(pack({"ts": 1, "events": [], "data_parallel_rank": 2})) == KVEventBatch(1.0, [], 2)


def test_unknown_event_type_is_skipped_not_fatal() -> None:
    batch = decode_payload(pack([1.0, [["SomethingNew", 1, 2], ["BlockRemoved", [5], "GPU"]], 0]))
    assert batch.events == [BlockRemoved([5], "GPU")]


BAD_PAYLOADS = {
    "bad_msgpack": [b"", b"\x93\x01", pack([1.0, []])[:-1] + b"\xc1", pack([1.0, []]) + b"\x00"],
    "bad_batch": [pack(7), pack([1.0]), pack([1.0, [], 0, 9]), pack(["x", []]), pack([1.0, {}]),
                  pack([1.0, [], -1]), pack([1.0, [], "dp"]), pack({"ts": 1}), pack([True, []]),
                  pack([float("nan"), []])],
    "bad_event": [pack([1.0, [5]]), pack([1.0, [[7, 1]]]), pack([1.0, [[]]])],
    "missing_field": [pack([1.0, [["BlockStored", [1], None, [1]]]]),
                      pack([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
                      pack([1.0, [["BlockRemoved"]]])],
    "bad_hash": [pack([1.0, [["BlockRemoved", [1.5]]]]), pack([1.0, [["BlockRemoved", ["ab"]]]]),
                 pack([1.0, [["BlockRemoved", 5]]]), pack([1.0, [["BlockRemoved", [b""]]]]),
                 pack([1.0, [["BlockRemoved", [True]]]]),
                 pack([1.0, [["BlockStored", [1], "p", [1], 1]]])],
    "bad_tokens": [pack([1.0, [["BlockStored", [1], None, [1, -1], 2]]]),
                   pack([1.0, [["BlockStored", [1], None, [1, 2**32], 2]]]),
                   pack([1.0, [["BlockStored", [1], None, [1, 1.0], 2]]]),
                   pack([1.0, [["BlockStored", [1], None, [1, "2"], 2]]]),
                   pack([1.0, [["BlockStored", [1], None, [[1, 2]], 2]]]),
                   pack([1.0, [["BlockStored", [1], None, "12", 2]]])],
    "bad_field": [pack([1.0, [["BlockStored", [1], None, [1, 2], 0]]]),
                  pack([1.0, [["BlockStored", [1], None, [1, 2], "2"]]]),
                  pack([1.0, [["BlockStored", [1], None, [1, 2], 2, None, 5]]]),
                  pack([1.0, [["BlockStored", [1], None, [1, 2], 2, "id"]]])],
}


@pytest.mark.parametrize("reason,payload", [(r, p) for r, ps in BAD_PAYLOADS.items() for p in ps])
def test_bad_payloads_are_refused_with_reason(reason: str, payload: bytes) -> None:
    with pytest.raises(MalformedEvent) as info:
        decode_payload(payload)
    assert info.value.reason == reason


@pytest.mark.parametrize("frames", [
    [], [b"t"], [b"t", (0).to_bytes(8, "big")], [b"t", b"\x00" * 8, b"", b"extra"],
])
def test_wrong_frame_count(frames: list[bytes]) -> None:
    with pytest.raises(MalformedEvent) as info:
        decode_message(frames)
    assert info.value.reason == "frame_count"


def test_bad_seq_frame() -> None:
    with pytest.raises(MalformedEvent) as info:
        decode_message([b"", b"\x00" * 7, pack([1.0, []])])
    assert info.value.reason == "bad_seq"


def test_huge_token_lists_and_payloads_are_refused() -> None:
    limits = DecodeLimits(max_payload_bytes=1 << 20, max_tokens_per_event=1000, max_hashes_per_event=10)
    many_tokens = pack([1.0, [["BlockStored", [1], None, list(range(1001)), 1001]]])
    with pytest.raises(MalformedEvent) as info:
        decode_payload(many_tokens, limits)
    assert info.value.reason == "too_large"
    many_hashes = pack([1.0, [["BlockRemoved", list(range(11))]]])
    with pytest.raises(MalformedEvent) as info:
        decode_payload(many_hashes, limits)
    assert info.value.reason == "too_large"
    with pytest.raises(MalformedEvent) as info:
        decode_payload(b"\x00" * ((1 << 20) + 1), limits)
    assert info.value.reason == "too_large"
    # The default limit refuses a two-million-token event.
    with pytest.raises(MalformedEvent) as info:
        decode_payload(pack([1.0, [["BlockStored", [1], None, [1] * 2_000_000, 2_000_000]]]))
    assert info.value.reason == "too_large"


PAYLOAD_REASONS = {"too_large", "bad_msgpack", "bad_batch", "bad_event", "bad_field", "bad_hash",
                   "bad_tokens", "missing_field"}
"""The reasons decode_payload may give: stable metric labels, so an unknown one is a bug too."""


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        batch = decode_payload(data)
    except MalformedEvent as exc:
        assert exc.reason in PAYLOAD_REASONS, f"unknown reason {exc.reason!r}: {exc}"
    else:
        assert isinstance(batch, KVEventBatch)


@settings(max_examples=200, deadline=None)
@given(BATCHES, st.integers(1, 40))
def test_truncated_payloads_are_malformed(batch: KVEventBatch, cut: int) -> None:
    payload = encode_payload(batch, "array")
    if cut >= len(payload):
        return
    with pytest.raises(MalformedEvent):
        decode_payload(payload[:-cut])
