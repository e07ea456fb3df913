"""Malformed etcd keys and values are data, never control flow.

Every decoder of a stored key or value raises its own ``MalformedValue`` and nothing else, for
any bytes (hypothesis); and a block mirror (real etcd) skips a poisoned segment (``"n": true``,
``n`` past ``MAX_SEGMENT_BLOCKS``), counts it by reason and goes on applying the segments and
deletions after it, without a reload. The other watchers are in
``tests/router/test_etcd_value_skips.py``."""
from __future__ import annotations

import json
import logging
import struct

import msgpack
import pytest
from agent_helpers import wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

from index.errors import MalformedKey, MalformedValue, RecordError
from index.etcd import Delete, EtcdClient
from index.follow import skipped_totals
from index.framing import pack, unpack
from index.keys import KeyLayout
from index.mirror import BlockMirror, BlockMirrorConfig
from index.record import InstanceRecord
from index.segments import MAX_SEGMENT_BLOCKS, MalformedSegment, decode, encode

pytestmark = pytest.mark.timeout(120)

FAST = BlockMirrorConfig(progress_every=0.05)
LAYOUT = KeyLayout("/kvatlas")

# msgpack-able values of every type a header field could hold, nested a little.
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
           | st.text(max_size=8) | st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=4), inner, max_size=4), max_leaves=8)
headers = st.fixed_dictionaries(
    {"v": st.sampled_from([2, True, 2.0, 1]), "t": values, "p": values, "m": values,
     "n": st.one_of(st.integers(-3, 200), st.booleans(), values)},
    optional={"x": values})


def _refuses_only_its_own(decoder, error: type[MalformedValue], raw: bytes) -> None:  # type: ignore[no-untyped-def]
    try:
        decoder(raw)
    except error:
        pass  # anything else propagates and fails the test


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_every_decoder_refuses_any_bytes_with_its_own_error(raw: bytes) -> None:
    _refuses_only_its_own(decode, MalformedSegment, raw)
    _refuses_only_its_own(lambda r: unpack(r, 2, MalformedSegment), MalformedSegment, raw)
    _refuses_only_its_own(lambda r: InstanceRecord.from_json(r, key=b"k", instance_id="i"),
                          RecordError, raw)
    for parse in (LAYOUT.parse_instance, LAYOUT.parse_rank, LAYOUT.parse_segment,
                  LAYOUT.parse_prediction):
        for prefix in (LAYOUT.instances_prefix(), LAYOUT.ranks_prefix(), LAYOUT.blocks_prefix(),
                       LAYOUT.predictions_prefix(), b""):
            _refuses_only_its_own(parse, MalformedKey, prefix + raw)


@settings(max_examples=300, deadline=None)
@given(headers, st.binary(max_size=64 * 9 + 8))
def test_a_segment_header_of_any_types_decodes_or_is_refused(header: dict, body: bytes) -> None:  # type: ignore[type-arg]
    try:
        seg = decode(pack(header, body))
    except MalformedSegment:
        return
    # What decodes is what a writer could have written: strict types, at most 64 blocks.
    assert type(header["n"]) is int and 0 <= header["n"] <= MAX_SEGMENT_BLOCKS
    assert len(seg.hashes) == len(seg.media) == header["n"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "instance_id", "role", "url", "started_at",
                                        "bootstrap_port", "tp_size", "ready", "hash_namespace",
                                        "topology", "tokenizer", "x"]), values, max_size=8))
def test_a_record_of_any_types_parses_or_is_refused(doc: dict) -> None:  # type: ignore[type-arg]
    raw = msgpack.packb(doc)  # not JSON: the record parser must refuse it cleanly too
    _refuses_only_its_own(lambda r: InstanceRecord.from_json(r, instance_id="i"), RecordError, raw)
    try:
        text = json.dumps(doc, default=repr)
    except (TypeError, ValueError):
        return
    _refuses_only_its_own(lambda r: InstanceRecord.from_json(r, instance_id="i"), RecordError,
                          text.encode())


def poisoned(n: object, blocks: int) -> bytes:
    """A segment value whose header says ``n`` blocks, followed by ``blocks`` of them."""
    return pack({"v": 2, "t": 1.0, "p": None, "m": ["GPU"], "n": n},
                struct.pack(f"<{blocks}Q", *range(1, blocks + 1)))


@pytest.mark.parametrize("n,blocks,reason", [
    (True, 1, "bad_count"),          # a bool is an int to Python: it once sized a struct format
    (100_000, 100_000, "bad_count"),  # once accepted: the index grew by 100k blocks
    (65, 65, "bad_count"),
])
async def test_a_poisoned_segment_is_skipped_and_later_changes_apply(
        etcd: EtcdClient, layout: KeyLayout, caplog: pytest.LogCaptureFixture, n: object,
        blocks: int, reason: str) -> None:
    good_a = layout.segment("m", "a", 1)
    good_b = layout.segment("m", "b", 1)
    await etcd.put(good_a, encode(1.0, None, [0xA1], ["GPU"]))
    mirror = BlockMirror(etcd, layout, "m", FAST)
    mirror.start()
    before = skipped_totals().get(("blocks", reason), 0)
    try:
        assert await mirror.wait_ready(10)
        assert mirror.blocks("a") == {0xA1}
        caplog.set_level(logging.WARNING, "index.follow")
        bad = layout.segment("m", "evil", 2)
        await etcd.put(bad, poisoned(n, blocks))
        await etcd.put(bad, poisoned(n, blocks))  # the same again: counted, not logged again
        await etcd.put(good_b, encode(2.0, None, [0xB1, 0xB2], ["GPU"]))
        rev = await etcd.txn([Delete(good_a)])
        assert await mirror.wait_revision(rev, 10), mirror.stats()
        assert mirror.instances() == {"b"} and mirror.blocks("b") == {0xB1, 0xB2}
        assert mirror.block_count() == 2  # nothing of the poisoned value got in
        assert mirror.skipped == {reason: 2} and mirror.bad_values == 2
        assert mirror.errors == 0 and mirror.reloads == 1 and mirror.connected
        assert skipped_totals()[("blocks", reason)] == before + 2
        logged = [r for r in caplog.records if "evil" in r.getMessage()]
        assert len(logged) == 1 and reason in logged[0].getMessage(), caplog.text
        # A mirror that starts with the poisoned key in place loads the rest.
        late = BlockMirror(etcd, layout, "m", FAST)
        late.start()
        try:
            assert await late.wait_ready(10)
            assert late.instances() == {"b"} and late.skipped == {reason: 1}
        finally:
            await late.close()
        # A good value under the poisoned key is read again.
        rev = await etcd.put(bad, encode(3.0, None, [0xE1], ["GPU"]))
        assert await mirror.wait_revision(rev, 10)
        assert mirror.blocks("evil") == {0xE1}
    finally:
        await mirror.close()


async def test_a_non_utf8_segment_key_is_skipped_and_its_delete_too(
        etcd: EtcdClient, layout: KeyLayout) -> None:
    mirror = BlockMirror(etcd, layout, "m", FAST)
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        bad = layout.blocks_prefix("m") + b"\xff\xfe/0000000000000001"
        await etcd.put(bad, encode(1.0, None, [5], ["GPU"]))
        await etcd.delete(bad)
        rev = await etcd.put(layout.segment("m", "a", 1), encode(1.0, None, [6], ["GPU"]))
        assert await mirror.wait_revision(rev, 10)
        await wait_until(lambda: mirror.blocks("a") == {6}, what="the good segment")
        assert mirror.skipped == {"bad_key": 2} and mirror.errors == 0
    finally:
        await mirror.close()
