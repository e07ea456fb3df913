"""Routing predictions shared between routers: the wire form, kv_aware's use of a peer's
prediction, and the publisher and follower against a real etcd."""
from __future__ import annotations

import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from router_stubs import encode_text
from test_kv_aware import conversation, make_kv, route, workers
from waiting import wait_until

from index.etcd import EtcdClient
from index.framing import pack
from index.keys import KeyLayout
from index.table import BlockTable
from router.policy import RouteContext
from router.shared_predictions import (
    SLOTS,
    MalformedPrediction,
    PeerPredictions,
    PredictionPublisher,
    ShareStats,
    decode,
    encode,
)

items_st = st.lists(st.tuples(
    st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True),
    st.one_of(st.none(), st.text(min_size=1, max_size=20)),
    st.lists(st.integers(0, 2**64 - 1), max_size=40).map(tuple)), max_size=20)


@given(items_st, st.floats(0, 2e9))
def test_a_value_decodes_to_what_was_encoded(items: list, t: float) -> None:
    assert decode(encode(t, items)) == (t, items)


@pytest.mark.parametrize("raw,reason", [
    (b"\x00\x00", "truncated"),
    (struct.pack(">I", 3) + b"\xc1\xc1\xc1", "bad_header"),
    (pack({"v": 2, "t": 1.0, "items": []}), "version"),
    (pack({"v": 1, "items": []}), "bad_header"),
    (pack({"v": 1, "t": 1.0, "items": [["p0", None, 2]]}, b"\x00" * 12), "bad_hashes"),
    (pack({"v": 1, "t": 1.0, "items": [["p0", None, 2]]}, b"\x00" * 8), "bad_hashes"),
    (pack({"v": 1, "t": 1.0, "items": [["p0", 5, 0]]}), "bad_item"),
    (pack({"v": 1, "t": 1.0, "items": [["p0", None, -1]]}), "bad_item"),
])
def test_a_malformed_value_is_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedPrediction) as err:
        decode(raw)
    assert err.value.reason == reason


# --- kv_aware with a peer's predictions ---------------------------------------------------------

def test_a_peer_prediction_steers_a_follow_up_like_an_own_one() -> None:
    """Turn one went through another router to p2; nothing is indexed yet. Without the peer's
    prediction this router sends turn two by load alone; with it, to p2."""
    ws = workers(3)
    turn1, turn2 = conversation(7), conversation(7, turns=2)
    hashes = RouteContext(encode_text(turn1)).hashes(*_hasher_and_seed())
    lonely, _ = make_kv(BlockTable())
    assert route(lonely, ws, turn2).matched_blocks <= 3  # the shared header at most
    for w in ws:
        w.load = 0
    kv, _ = make_kv(BlockTable())
    kv.peer_routed("p2", None, hashes)
    c = route(kv, ws, turn2)
    assert c.worker.instance_id == "p2" and c.matched_blocks == len(hashes)
    assert c.indexed_blocks == 0
    chosen = next(x for x in c.candidates if x["instance_id"] == "p2")
    # Its request is in the other router's load, not this one's: no load discount.
    assert chosen["load_blocks"] == 0.0 and chosen["predicted_blocks"] == len(hashes)


def test_a_peer_prediction_goes_once_the_index_knows_the_instance_and_catch_up_passed() -> None:
    table = BlockTable()
    kv, clock = make_kv(table, prediction_catch_up=5.0)
    ws = workers(2)
    text = conversation(3)
    hashes = RouteContext(encode_text(text)).hashes(*_hasher_and_seed())
    kv.peer_routed("p1", None, hashes)
    table.apply_add("p1", hashes[:1])  # the index shows p1 (one block of it)
    c = route(kv, ws, conversation(3, turns=2))
    assert c.worker.instance_id == "p1" and c.matched_blocks == len(hashes)
    clock.t += 6.0  # past catch-up: the index alone counts now
    c = route(kv, ws, conversation(3, turns=2))
    assert c.matched_blocks < len(hashes)
    assert len(kv.peer) == 0


def _hasher_and_seed() -> tuple:
    kv, _ = make_kv(None)
    return kv.hasher, kv.seed


def test_only_predictions_the_index_does_not_already_show_are_shared() -> None:
    table = BlockTable()
    kv, _ = make_kv(table)
    shared: list[tuple] = []
    kv.share = lambda i, m, h: shared.append((i, m, tuple(h)))
    ws = workers(2)
    c = route(kv, ws, conversation(1))
    assert shared == [(c.worker.instance_id, None, tuple(c.hashes))]
    table.apply_add(c.worker.instance_id, c.hashes)
    c.worker.load = 0
    route(kv, ws, conversation(1))  # fully indexed there: nothing new to predict
    assert len(shared) == 1


# --- through a real etcd ------------------------------------------------------------------------

async def test_routers_see_each_others_predictions_through_etcd_and_not_their_own(
        etcd: EtcdClient, layout: KeyLayout) -> None:
    got: dict[str, list[tuple]] = {"a": [], "b": []}
    stats = {r: ShareStats() for r in got}
    pubs = {r: PredictionPublisher(etcd, layout, f"router-{r}", 0.005, stats[r]) for r in got}
    peers = {r: PeerPredictions(etcd, layout, f"router-{r}",
                                lambda i, m, h, r=r: got[r].append((i, m, h)), 5.0, stats[r])
             for r in got}
    try:
        for r in got:
            pubs[r].start()
            peers[r].start()
            assert await peers[r].wait_ready(5)
        hashes = tuple(range(2**63, 2**63 + 30))
        pubs["a"].offer("p0", "tiny", hashes)
        pubs["a"].offer("p1", None, hashes[:3])
        await wait_until(lambda: len(got["b"]) == 2, what="router b to hear a's 2 predictions",
                         detail=lambda: got)
        assert got["b"] == [("p0", "tiny", hashes), ("p1", None, hashes[:3])]
        assert stats["a"].flushes == 1 and stats["a"].shared == 2 and stats["a"].bytes > 240
        # The ring wraps: etcd holds SLOTS keys of router a. (Flushed faster than etcd takes
        # them, a slot written twice before its put goes out carries the newer value only.)
        for i in range(SLOTS + 5):
            pubs["a"].flush([("p0", None, (i,))])
        await pubs["a"].keys.wait_synced(5)
        final = set(range(5, SLOTS + 5))  # what each slot holds last
        await wait_until(lambda: {h[0] for _, _, h in got["b"][2:]} >= final,
                         what="router b to hear a's final predictions", detail=lambda: got)
        _, kvs = await etcd.get_prefix(layout.predictions_prefix("router-a"))
        assert len(kvs) == SLOTS
        assert got["a"] == []  # its own come back through the watch and are skipped
    finally:
        for r in got:
            await peers[r].close()
            await pubs[r].close()
    # Closing revoked each ring's lease: nothing of either router is left.
    _, kvs = await etcd.get_prefix(layout.predictions_prefix())
    assert kvs == []


async def test_a_snapshot_takes_only_recent_predictions_and_counts_bad_values(
        etcd: EtcdClient, layout: KeyLayout) -> None:
    hashes = (1, 2, 3)
    await etcd.put(layout.prediction("old", 0), encode(time.time() - 60, [("p0", None, hashes)]))
    await etcd.put(layout.prediction("new", 0), encode(time.time(), [("p1", None, hashes)]))
    await etcd.put(layout.prediction("bad", 0), b"\x00\x00\x00\x09not msgpack")
    got: list[tuple] = []
    stats = ShareStats()
    peers = PeerPredictions(etcd, layout, "me", lambda i, m, h: got.append((i, m, h)), 5.0,
                            stats)
    peers.start()
    try:
        assert await peers.wait_ready(5)
        assert got == [("p1", None, hashes)]
        assert stats.stale == 1 and stats.received == 1
        assert peers.refused == {"bad_header": 1}
    finally:
        await peers.close()
