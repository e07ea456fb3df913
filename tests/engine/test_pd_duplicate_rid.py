"""A client ``rid`` reused by concurrent PD requests: the decode refuses a duplicate with a 409
before it reserves a page, the prefill before it opens a room or computes, a batch is refused
whole, the request already in flight keeps its pages, and both pools are back at rest after
every refused, aborted or failed request (the 16-request burst the issue reported leaked pages on
both halves and answered 502s and a 500 "page released more often than referenced")."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from engine_helpers import assert_idle, wait_until
from pd_helpers import Pair, dual, fast_transfer, new_room, pd_body, start_pair
from pd_procs import assert_at_rest, internal_states, proc_pair

pytestmark = pytest.mark.timeout(120)
IDS = [256, *b"a prompt served by the disaggregated pair, more than one block"]


@pytest.fixture
async def quick_pair() -> Any:
    # a prefill whose decode never comes (it refused the request) gives up after 2 s
    p = await start_pair(prefill_over={"transfer": fast_transfer(bootstrap_timeout_s=2.0)})
    try:
        yield p
    finally:
        await p.decode.close()
        await p.prefill.close()


def both_idle(pair: Pair) -> None:
    assert_idle(pair.ps.replica)
    assert_idle(pair.ds.replica)


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + "/generate", json=body) as r:
        return r.status, await r.json()


def refused(status: int, doc: Any, rid: str) -> bool:
    return status == 409 and repr(rid) in doc["error"]


async def served_at_rest(s: aiohttp.ClientSession, pair: Pair, rid: str) -> None:
    """Both pools at rest, and then a request under ``rid`` (free again) served by the pair."""
    both_idle(pair)
    (pstatus, _), (dstatus, _) = await dual(s, pair.p_url, pair.d_url,
                                            {**pd_body(IDS, 3, pair.bport), "rid": rid})
    assert (pstatus, dstatus) == (200, 200)
    both_idle(pair)


async def test_sixteen_pd_requests_under_one_rid(quick_pair: Pair) -> None:
    pair = quick_pair
    ds = pair.ds.replica
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(dual(s, pair.p_url, pair.d_url,
                                         {**pd_body(IDS, 1000, pair.bport), "rid": "same"}))
        await wait_until(lambda: [r.rid for r in ds.running] == ["same"], "the first decoding")
        [running] = ds.running
        table, free = list(running.table), ds.pool.num_free
        bodies = [{**pd_body(IDS, 5, pair.bport), "rid": "same"} for _ in range(15)]
        # what the router does: each body to both halves at once
        prefills = [asyncio.create_task(post(s, pair.p_url, b)) for b in bodies]
        decodes = await asyncio.gather(*(post(s, pair.d_url, b) for b in bodies))
        assert all(refused(st, doc, "same") for st, doc in decodes), decodes
        # the decode never reserved a page for a refused request
        assert ds.running == [running] and running.table == table and ds.pool.num_free == free
        for pstatus, pdoc in await asyncio.gather(*prefills):
            # the prefill had finished the first one: it served the newcomer and gave up on it
            # when no decode came for its room
            assert pstatus == 502 or refused(pstatus, pdoc, "same"), (pstatus, pdoc)
        (pstatus, _), (dstatus, ddoc) = await first
        assert (pstatus, dstatus) == (200, 200) and len(ddoc["output_ids"]) == 1000
        await served_at_rest(s, pair, "same")


async def test_a_prefill_refuses_an_id_whose_decode_it_still_waits_for(quick_pair: Pair
                                                                      ) -> None:
    pair = quick_pair
    ps = pair.ps.replica
    room = new_room()
    async with aiohttp.ClientSession() as s:
        # a prefill whose decode has not come yet: it waits under its id, holding no page
        first = asyncio.create_task(post(s, pair.p_url, {**pd_body(IDS, 4, pair.bport, room),
                                                         "rid": "p"}))
        await wait_until(lambda: room in pair.ps.awaiting_decode, "the first prefill waiting")
        dups = await asyncio.gather(*(post(s, pair.p_url, {**pd_body(IDS, 4, pair.bport),
                                                           "rid": "p"}) for _ in range(15)))
        assert all(refused(st, doc, "p") for st, doc in dups), dups
        assert room in pair.ps.awaiting_decode
        assert not ps.held and ps.pool.total_refs == 0 and ps.totals["requests"] == 0
        # no decode ever asks for its room: it gives up and gives its pages back
        status, _ = await first
        assert status == 502
        await served_at_rest(s, pair, "p")


async def test_a_pd_batch_is_refused_whole(quick_pair: Pair) -> None:
    pair = quick_pair
    prompts = [[256, 1, 2], [256, 3], [256, 4]]

    def batch(rids: list[str]) -> dict[str, Any]:
        return {**pd_body(prompts[0], 2, pair.bport), "input_ids": prompts, "rid": rids,
                "bootstrap_room": [new_room() for _ in prompts]}

    async with aiohttp.ClientSession() as s:
        for url in (pair.p_url, pair.d_url):
            status, doc = await post(s, url, batch(["a", "b", "a"]))
            assert refused(status, doc, "a") and "twice" in doc["error"], doc
        both_idle(pair)
        assert not pair.ds.rooms.active and not pair.ds.rooms.finished
        first = asyncio.create_task(dual(s, pair.p_url, pair.d_url,
                                         {**pd_body(IDS, 400, pair.bport), "rid": "busy"}))
        await wait_until(lambda: bool(pair.ds.replica.running), "the first decoding")
        status, doc = await post(s, pair.d_url, batch(["x", "busy", "y"]))
        assert refused(status, doc, "busy"), doc
        assert len(pair.ds.rooms.active) == 1  # no room of the batch opened
        (pstatus, _), (dstatus, _) = await first
        assert (pstatus, dstatus) == (200, 200)
    both_idle(pair)


async def test_pools_at_rest_after_refused_aborted_and_failed(quick_pair: Pair) -> None:
    pair = quick_pair
    async with aiohttp.ClientSession() as s:
        # refused: bad input, a used room
        for url in (pair.p_url, pair.d_url):
            status, _ = await post(s, url, {**pd_body(IDS, 3, pair.bport), "rid": ["x"]})
            assert status == 400
            both_idle(pair)
        body = pd_body(IDS, 3, pair.bport)
        (pstatus, _), (dstatus, _) = await dual(s, pair.p_url, pair.d_url, body)
        assert (pstatus, dstatus) == (200, 200)
        status, doc = await post(s, pair.d_url, body)
        assert status == 400 and "already used" in doc["error"]
        both_idle(pair)
        # failed: corrupted KV
        bad = pd_body(IDS, 3, pair.bport)
        pair.ps.sender.hooks.corrupt_rooms.add(bad["bootstrap_room"])
        (pstatus, _), (dstatus, _) = await dual(s, pair.p_url, pair.d_url, bad)
        assert (pstatus, dstatus) == (502, 502)
        both_idle(pair)
        # failed: a prefill whose decode never comes
        status, _ = await post(s, pair.p_url, pd_body(IDS, 3, pair.bport))
        assert status == 502
        both_idle(pair)
        # aborted: a decode stream whose client leaves mid-way
        body = {**pd_body(IDS, 1500, pair.bport), "stream": True}
        prefilled = asyncio.create_task(post(s, pair.p_url, body))
        async with s.post(pair.d_url + "/generate", json=body) as dresp:
            assert dresp.status == 200
            await dresp.content.readline()
            dresp.close()
        assert (await prefilled)[0] == 200
        await wait_until(lambda: not pair.ds.replica.running
                         and pair.ds.replica.pool.total_refs == 0, "the stream aborted")
        both_idle(pair)


async def test_a_burst_under_one_rid_on_real_processes(etcd_endpoint: str,
                                                       key_prefix: str) -> None:
    """The issue's burst against `kvatlas engine serve` processes registered in etcd: the pool
    accounting each reports in /server_info is back at rest afterwards."""
    common = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
              "--transfer-bootstrap-timeout", "2")
    with proc_pair(*common, prefill_extra=("--instance-id", "dup-pre"),
                   decode_extra=("--instance-id", "dup-dec")) as (prefill, decode):
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(dual(s, prefill.url, decode.url,
                                             {**pd_body(IDS, 600, prefill.bport), "rid": "r"}))
            while (await internal_states(s, decode.url))["running"] != 1:
                await asyncio.sleep(0.05)
            dups = await asyncio.gather(*(dual(s, prefill.url, decode.url,
                                               {**pd_body(IDS, 5, prefill.bport), "rid": "r"})
                                          for _ in range(15)))
            assert all(refused(d, ddoc, "r") for _, (d, ddoc) in dups), dups
            assert all(p in (409, 502) for (p, _), _ in dups), dups
            (pstatus, _), (dstatus, _) = await first
            assert (pstatus, dstatus) == (200, 200)
            await assert_at_rest(s, prefill.url, decode.url)
