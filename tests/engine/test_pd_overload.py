"""PD admission cannot deadlock: a prefill computes a room (and pins its pages) only after the
room's decode asked for it, which the decode does only once it reserved the room's pages.

With the old order (compute first, then wait for the decode) small pools filled up with rooms
waiting on each other: the prefill's pool with computed rooms whose decodes had no pages, the
decode's with reservations for rooms the prefill could not compute, until the timeouts failed
them. Here both pools hold two rooms each, many more rooms arrive at once, and the decode sees
them in the reverse of the prefill's order: all complete and both pools end at rest."""
from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from engine_helpers import assert_idle, wait_until
from pd_helpers import Pair, fast_transfer, monolithic, new_room, pd_body, start_pair
from pd_procs import assert_at_rest, proc_pair

pytestmark = pytest.mark.timeout(240)

PAGE = 16
POOL = 28  # pages: each pool holds two of the rooms below, never three
PROMPT = 12 * PAGE - 3  # a room takes 12 pages on the prefill and 12 on the decode
NEW = 4
ROOMS = 10


def prompts() -> list[list[int]]:
    rng = random.Random(7)  # distinct prompts: no room's pages come from another's cache
    return [[256, *(rng.randrange(1, 255) for _ in range(PROMPT - 1))] for _ in range(ROOMS)]


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + "/generate", json=body) as r:
        return r.status, await r.json()


async def debug_pd(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/debug/pd") as r:
        return await r.json()  # type: ignore[no-any-return]


async def test_more_rooms_than_both_pools_hold_all_complete() -> None:
    ids = prompts()
    want = monolithic(ids, [NEW] * ROOMS)
    pool = ("--num-pages", str(POOL), "--page-size", str(PAGE), "--max-running", "64")
    with proc_pair(*pool) as (prefill, decode):
        bodies = [pd_body(p, NEW, prefill.bport, new_room()) for p in ids]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as s:
            # every prefill half first, then the decode halves in the reverse order: the old
            # order computed the first rooms on the prefill while the decode reserved the last
            pre = [asyncio.create_task(post(s, prefill.url, b)) for b in bodies]
            dec = [asyncio.create_task(post(s, decode.url, b)) for b in reversed(bodies)]
            pres = await asyncio.gather(*pre)
            decs = list(reversed(await asyncio.gather(*dec)))
            assert [st for st, _ in pres] == [200] * ROOMS, pres
            assert [st for st, _ in decs] == [200] * ROOMS, decs
            assert [doc["output_ids"] for _, doc in decs] == want
            await assert_at_rest(s, prefill.url, decode.url)
            p_doc, d_doc = await debug_pd(s, prefill.url), await debug_pd(s, decode.url)
            assert (p_doc["held"], p_doc["sending"], p_doc["awaiting_decode"]) == (0, 0, 0), p_doc
            assert d_doc["kv_pages_free"] == d_doc["kv_pages_total"] == POOL, d_doc
            assert (p_doc["sent"], d_doc["ok"]) == (ROOMS, ROOMS), (p_doc, d_doc)


SMALL = [256, *b"a room that waits for the decode's only free pages"]  # 4 pages with NEW


@pytest.fixture
async def one_room_decode() -> AsyncIterator[Pair]:
    """In-process pair whose decode pool holds one room of ``SMALL``; nothing times out."""
    patient = fast_transfer(bootstrap_timeout_s=120.0, waiting_timeout_s=120.0)
    p = await start_pair(decode_over={"num_pages": 4, "transfer": patient},
                         prefill_over={"transfer": patient})
    try:
        yield p
    finally:
        await p.decode.close()
        await p.prefill.close()


async def test_a_room_waiting_for_pages_is_woken_by_their_release(
        one_room_decode: Pair) -> None:
    pair = one_room_decode
    replica = pair.ds.replica
    need = replica.pages_needed(len(SMALL), NEW)
    assert need == replica.pool.num_pages
    attempts: list[int] = []
    reserve = replica.reserve

    def counted(prompt_len: int, max_new: int) -> list[int] | None:
        pages = reserve(prompt_len, max_new)
        attempts.append(0 if pages is None else len(pages))
        return pages

    replica.reserve = counted  # counts the tries; the engine thread still reserves
    async with aiohttp.ClientSession() as s:
        # room A: its decode half alone takes every page and waits for a prefill never sent
        a = asyncio.create_task(post(s, pair.d_url, pd_body(SMALL, NEW, pair.bport)))
        await wait_until(lambda: replica.pool.num_free == 0, "room A reserving the pages")
        body = pd_body(SMALL, NEW, pair.bport)
        b_pre = asyncio.create_task(post(s, pair.p_url, body))
        b_dec = asyncio.create_task(post(s, pair.d_url, body))
        await wait_until(lambda: len(attempts) >= 2, "room B trying to reserve")
        assert attempts == [need, 0]
        assert body["bootstrap_room"] in pair.ps.awaiting_decode
        assert pair.ps.replica.totals["requests"] == 0, "room B ran before its decode asked"
        # an observation window, not a wait for a state: no page is freed during it, so a
        # waiter that sleeps until pages are freed makes no attempt (the 5 ms poll made ~100)
        await asyncio.sleep(0.5)
        assert attempts == [need, 0], "room B polled for pages while none was freed"
        a.cancel()  # room A's client leaves: its pages come back and wake room B
        await asyncio.gather(a, return_exceptions=True)
        (pst, _), (dst, doc) = await asyncio.gather(b_pre, b_dec)
        assert (pst, dst) == (200, 200), doc
        assert attempts == [need, 0, need], attempts
    assert_idle(replica)
    assert_idle(pair.ps.replica)


async def test_a_room_no_decode_asks_for_fails_without_being_computed() -> None:
    pair = await start_pair(prefill_over={"transfer": fast_transfer(bootstrap_timeout_s=1.0)})
    try:
        async with aiohttp.ClientSession() as s:
            status, doc = await post(s, pair.p_url, pd_body(SMALL, NEW, pair.bport))
        assert status == 502 and doc["stage"] == "BOOTSTRAPPING", doc
        assert "was not computed" in doc["error"] and "no decode rank asked" in doc["error"]
        assert pair.ps.replica.totals["requests"] == 0 and not pair.ps.awaiting_decode
        assert_idle(pair.ps.replica)
    finally:
        await pair.decode.close()
        await pair.prefill.close()
