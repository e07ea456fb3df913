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
from typing import Any

import aiohttp
import pytest
from pd_helpers import monolithic, new_room, pd_body
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
