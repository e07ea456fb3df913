"""PD failure paths with real sockets: a swapped room or a corrupted page fails only that request
(nothing written, pages freed, no token from foreign KV), mismatched page geometry or KV dtype is
refused naming both values, and a prefill killed while the decode waits fails the request within
the heartbeat window."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from engine_helpers import shared_prefix_prompts, wait_until
from pd_helpers import Pair, dual, monolithic, new_room, pair, pd_body, pd_config, start_pair  # noqa: F401
from pd_procs import Proc

from engine.pd.decode import create_decode_app

pytestmark = pytest.mark.timeout(120)


async def room_doc(s: aiohttp.ClientSession, url: str, room: int) -> dict:
    async with s.get(f"{url}/debug/rooms/{room}") as r:
        assert r.status == 200
        return await r.json()


@pytest.mark.parametrize("fault", ["room_override", "corrupt"])
async def test_bad_kv_fails_only_that_request(pair: Pair, fault: str) -> None:
    prompts = shared_prefix_prompts(8, seed=9, n_bases=2)
    want = monolithic(prompts, [5] * 8)
    rooms = [new_room() for _ in prompts]
    bad = rooms[3]
    if fault == "room_override":
        pair.ps.sender.hooks.room_override[bad] = bad + 1
    else:
        pair.ps.sender.hooks.corrupt_rooms.add(bad)
    async with aiohttp.ClientSession() as s:
        res = await asyncio.gather(*(dual(s, pair.p_url, pair.d_url, pd_body(p, 5, pair.bport, r))
                                     for p, r in zip(prompts, rooms)))
        for i, ((ps, pbody), (ds, dbody)) in enumerate(res):
            if i == 3:
                assert ds == 502 and "output_ids" not in dbody
                if fault == "room_override":
                    want_msg = f"bootstrap_room mismatch: expected {bad}, got {bad + 1}"
                    assert want_msg in dbody["error"]
                else:
                    assert "checksum mismatch" in dbody["error"]
                assert dbody["stage"] == "verified" and dbody["rank"] == "tp0"
                assert ps == 502  # the prefill hears about it too
                doc = await room_doc(s, pair.d_url, bad)
                assert doc["state"] == "failed" and doc["error"]["stage"] == "verified"
                assert "consumed" not in [st["stage"] for st in doc["stages"]]
            else:
                assert (ps, ds) == (200, 200), (pbody, dbody)
                assert dbody["output_ids"] == want[i]
    stats = pair.ds.rank.receiver.stats
    key = "room_mismatches" if fault == "room_override" else "checksum_failures"
    assert stats[key] == 1 and stats["rooms_ok"] == 7
    pool = pair.ds.replica.pool
    assert pool.num_free == pool.num_pages and not pair.ds.replica.running


async def test_a_batch_with_one_bad_item_fails_naming_it(pair: Pair) -> None:
    prompts = shared_prefix_prompts(3, seed=4, n_bases=1)
    rooms = [new_room() for _ in prompts]
    pair.ps.sender.hooks.corrupt_rooms.add(rooms[1])
    body = {**pd_body(prompts[0], 4, pair.bport), "input_ids": prompts, "bootstrap_room": rooms}
    async with aiohttp.ClientSession() as s:
        (ps, pbody), (ds, dbody) = await dual(s, pair.p_url, pair.d_url, body)
        assert (ps, ds) == (502, 502), (pbody, dbody)
        assert dbody["error"].startswith("batch item 1: ") and "checksum mismatch" in dbody["error"]
        assert dbody["item"] == 1 and dbody["stage"] == "verified" and dbody["room"] == rooms[1]
        assert pbody["item"] == 1
        # The other items were served whole; only the bad one failed.
        states = [(await room_doc(s, pair.d_url, r))["state"] for r in rooms]
    assert states == ["done", "failed", "done"]
    pool = pair.ds.replica.pool
    assert pool.num_free == pool.num_pages and not pair.ps.replica.held


@pytest.mark.parametrize("over, field, mine, theirs", [
    ({"page_size": 8}, "page_size", "8", "16"),
    ({"kv_cache_dtype": "float32"}, "kv_cache_dtype", "float32", "float64"),
])
async def test_mismatched_decode_is_refused_naming_both_values(
        over: dict, field: str, mine: str, theirs: str) -> None:
    p = await start_pair(decode_over=over)
    try:
        room = new_room()
        async with aiohttp.ClientSession() as s:
            async with s.post(p.d_url + "/generate",
                              json=pd_body([256, *b"mismatch"], 3, p.bport, room)) as r:
                body = await r.json()
            assert r.status == 502
            assert field in body["error"] and mine in body["error"] and theirs in body["error"]
            assert body["stage"] == "resolved_topology"
            doc = await room_doc(s, p.d_url, room)
            assert doc["state"] == "failed" and doc["stage"] == "registered"
        pool = p.ds.replica.pool
        assert pool.num_free == pool.num_pages
    finally:
        await p.decode.close()
        await p.prefill.close()


async def test_prefill_killed_mid_transfer_fails_within_heartbeat_window() -> None:
    prefill = Proc("prefill")
    decode = TestServer(create_decode_app(pd_config("decode")), host="127.0.0.1")
    try:
        prefill.wait_ready()
        await decode.start_server()
        d_url = str(decode.make_url("")).rstrip("/")
        from engine.pd.decode import DECODE_KEY
        ds = decode.app[DECODE_KEY]
        async with aiohttp.ClientSession() as s:
            # warm: a full PD request through the real prefill process
            (ps, _), (dcode, _) = await dual(s, prefill.url, d_url,
                                             pd_body([256, *b"warm up"], 2, prefill.bport))
            assert (ps, dcode) == (200, 200)
            # the decode asks for a room the prefill never computes, then the prefill dies
            room = new_room()
            task = asyncio.create_task(s.post(d_url + "/generate",
                                              json=pd_body([256, *b"doomed" * 9], 4,
                                                           prefill.bport, room)))
            await wait_until(lambda: (doc := ds.rooms.get(room)) is not None
                             and doc.stage == "connected", "the decode connected", 30.0)
            prefill.kill()
            resp = await asyncio.wait_for(task, 45)
            body = await resp.json()
            # "declared dead" is the heartbeat's doing: the waiting timeout, the other way this
            # request could end, says otherwise (so no clock is read here)
            assert resp.status == 502 and "declared dead" in body["error"], body
            assert body["stage"] == "verified"
            pool = ds.replica.pool
            assert pool.num_free == pool.num_pages
            assert ds.rooms.get(room).state == "failed"
    finally:
        prefill.stop()
        await decode.close()
