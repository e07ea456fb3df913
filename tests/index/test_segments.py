"""The block segments: their wire form, and the writer's segment bookkeeping (``SegmentSet``)
against a model of etcd and of a mirror that applies each segment write as a diff."""
from __future__ import annotations

import struct
from collections import deque

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from index.framing import pack
from index.segment_set import SegmentSet
from index.segments import (
    MAX_SEGMENT_BLOCKS,
    MalformedSegment,
    decode,
    encode,
    held_blocks,
    same_content,
)

hashes_st = st.lists(st.integers(0, 2**64 - 1), max_size=80)
media_st = st.sampled_from(["GPU", "CPU", "CPU_PINNED", "DISK"])


@given(hashes_st, st.one_of(st.none(), st.integers(0, 2**64 - 1)), st.data())
def test_a_segment_decodes_to_what_was_encoded(hashes: list[int], parent: int | None,
                                               data: st.DataObject) -> None:
    media = data.draw(st.lists(media_st, min_size=len(hashes), max_size=len(hashes)))
    seg = decode(encode(12.5, parent, hashes, media))
    assert (seg.t, seg.parent, seg.hashes, seg.media) == (12.5, parent, tuple(hashes),
                                                          tuple(media))
    assert held_blocks([encode(1.0, None, hashes, media)]) == dict(zip(hashes, media,
                                                                       strict=True))


def test_one_medium_costs_no_index_bytes() -> None:
    one = encode(1.0, None, [1, 2, 3], ["GPU"] * 3)
    two = encode(1.0, None, [1, 2, 3], ["GPU", "CPU", "GPU"])
    assert len(two) - len(one) == 3 + len(msgpack.packb("CPU"))


@pytest.mark.parametrize("raw,reason", [
    (b"\x00", "truncated"),
    (struct.pack(">I", 2) + b"\xc1\xc1", "bad_header"),
    (b'{"m":"GPU","p":null,"t":1.0}', "truncated"),  # a v1 block value: '{"m"' is no length
    (struct.pack(">I", 2**32 - 1) + b"\x80", "truncated"),  # a header past the value's end
    # Types are strict: a bool is an int to Python, and "n" sizes a buffer.
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": True}, b"\x00" * 8), "bad_count"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": 100_000}, b"\x00" * 800_000),
     "bad_count"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": 65}, b"\x00" * 8 * 65), "bad_count"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": -1}), "bad_count"),
    (pack({"v": True, "t": 1.0, "p": None, "m": ["GPU"], "n": 0}), "version"),
    (pack({"v": 2, "t": True, "p": None, "m": ["GPU"], "n": 0}), "bad_header"),
    (pack({"v": 2, "t": float("nan"), "p": None, "m": ["GPU"], "n": 0}), "bad_header"),
    (pack({"v": 2, "t": 1.0, "p": False, "m": ["GPU"], "n": 0}), "bad_header"),
    (pack({"v": 2, "t": 1.0, "p": -1, "m": ["GPU"], "n": 0}), "bad_header"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": "GPU", "n": 0}), "bad_header"),
    (pack({"v": 1, "t": 1.0, "p": None, "m": ["GPU"], "n": 0}), "version"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": [], "n": 1}, b"\x00" * 8), "bad_header"),
    (pack({"v": 2, "t": "x", "p": None, "m": ["GPU"], "n": 0}), "bad_header"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": 2}, b"\x00" * 8), "bad_length"),
    (pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU", "CPU"], "n": 1}, b"\x00" * 8 + b"\x07"),
     "bad_medium"),
])
def test_a_malformed_value_names_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedSegment) as err:
        decode(raw)
    assert err.value.reason == reason


def test_a_chain_fills_segments_and_a_decode_extends_its_prompts_segment() -> None:
    ss = SegmentSet()
    ss.add(None, list(range(1, 101)), "GPU")  # 100 blocks: two segments
    assert sorted(len(ss.segs[s]) for s in ss.live()) == [36, MAX_SEGMENT_BLOCKS]
    ss.add(None, [500], "GPU")
    ss.add(500, [501], "GPU")  # a decode stores one block at a time after its prompt
    ss.add(501, [502], "GPU")
    assert ss.seg_of[500] == ss.seg_of[501] == ss.seg_of[502]
    ss.add(500, [600], "GPU")  # a branch off the middle starts a segment of its own
    assert ss.seg_of[600] != ss.seg_of[500]
    ss.add(None, [1], "CPU")  # a medium change keeps the block's segment
    assert ss.blocks[1] == ("CPU", None) and ss.seg_of[1] == ss.seg_of[2]


class SegmentsAgainstEtcd(RuleBasedStateMachine):
    """Random changes, writes taken and landing later (several in flight, never two of one
    segment), failures; a mirror applies each landed write as a diff of that segment. At every
    moment the mirror equals the union of what etcd holds, and once everything landed, the set."""

    def __init__(self) -> None:
        super().__init__()
        self.ss = SegmentSet()
        self.etcd: dict[int, bytes] = {}
        self.mirror: set[int] = set()
        self.inflight: deque[tuple[list[tuple[int, bytes | None]], dict[int, set[int]]]] = deque()
        self.busy: set[int] = set()
        self.t = 0.0

    @rule(parent=st.one_of(st.none(), st.integers(0, 40)),
          hashes=st.lists(st.integers(0, 40), max_size=6, unique=True), medium=media_st)
    def add(self, parent: int | None, hashes: list[int], medium: str) -> None:
        self.ss.add(parent, hashes, medium)

    @rule(hashes=st.lists(st.integers(0, 40), max_size=8))
    def remove(self, hashes: list[int]) -> None:
        self.ss.remove(hashes)

    @rule()
    def take(self) -> None:
        """What the writer's flush does: the dirty segments not in flight, as one txn."""
        self.t += 1
        ss = self.ss
        keys = [s for s in ss.dirty if s not in self.busy]
        for s in keys:
            del ss.dirty[s]
        changed = [s for s in keys if ss.changed(s)]
        settles = {s: gone for s in changed if (gone := ss.take_removals(s))}
        writes = [(s, ss.value(s, self.t)) for s in changed]
        if writes:
            self.busy.update(s for s, _ in writes)
            self.inflight.append((writes, settles))

    @precondition(lambda self: self.inflight)
    @rule()
    def land(self) -> None:
        writes, settles = self.inflight.popleft()
        for s, value in writes:
            old = set(decode(self.etcd[s]).hashes) if s in self.etcd else set()
            new = set(decode(value).hashes) if value is not None else set()
            if value is None:
                self.etcd.pop(s, None)
            else:
                self.etcd[s] = value
            # The mirror's diff: what the segment no longer holds goes, what it holds is added.
            self.mirror -= old - new
            self.mirror |= new
            self.busy.discard(s)
        self.ss.settle(settles)

    @precondition(lambda self: self.inflight)
    @rule()
    def fail(self) -> None:
        """The newest write failed before etcd applied it; the writer resyncs: every segment
        written as it is now (a write per differing segment), and only then is it all settled."""
        writes, settles = self.inflight.pop()
        for s, _ in writes:
            self.busy.discard(s)
        self.ss.unsettle(settles)
        while self.inflight:
            self.land()
        ss = self.ss
        removals = ss.take_all_removals()
        ss.dirty.clear()
        self.t += 1
        snapshot = {s: ss.value(s, self.t) for s in list(ss.live())}
        for s in list(self.etcd):
            if s not in snapshot:
                self.inflight.append(([(s, None)], {}))
        for s, value in snapshot.items():
            if s not in self.etcd or not same_content(self.etcd[s], value):
                self.inflight.append(([(s, value)], {}))
        while self.inflight:
            self.land()
        ss.settle(removals)

    @invariant()
    def mirror_equals_etcd(self) -> None:
        stored = held_blocks(self.etcd.values())
        assert self.mirror == set(stored)
        # A block is in one segment only: the segments' sizes add up to the distinct blocks.
        assert sum(len(decode(v).hashes) for v in self.etcd.values()) == len(stored)

    @invariant()
    def segments_are_bounded_and_hold_the_set(self) -> None:
        ss = self.ss
        assert all(len(seg) <= MAX_SEGMENT_BLOCKS for seg in ss.segs.values())
        held = [h for seg in ss.segs.values() for h in seg]
        assert sorted(held) == sorted(ss.blocks)

    def teardown(self) -> None:
        # Everything written and landed: the mirror holds exactly the set, media included.
        self.take()
        while self.inflight:
            self.land()
        self.take()
        while self.inflight:
            self.land()
        stored = held_blocks(self.etcd.values())
        assert stored == {h: m for h, (m, _) in self.ss.blocks.items()}
        assert self.mirror == set(self.ss.blocks)


TestSegmentsAgainstEtcd = SegmentsAgainstEtcd.TestCase
TestSegmentsAgainstEtcd.settings = settings(max_examples=300, stateful_step_count=60,
                                            deadline=None)
