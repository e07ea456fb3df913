"""A client-chosen ``rid`` reused while a request under it is in flight: the engine refuses the
newcomer with a 409 naming the id (a batch whole, before any item starts), the request already
running keeps its pages, and the pool's accounting is back at rest after every refused, aborted
or failed request."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_helpers import assert_idle, greedy, wait_until

from engine.config import get_model_config
from engine.errors import DuplicateRequest
from engine.http_common import STATE_KEY
from engine.runner import AsyncEngine, build_scheduler
from engine.serve_config import EngineServerConfig
from engine.server import create_app

pytestmark = pytest.mark.timeout(90)
LONG_SP = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


async def start_long(c: Any, rid: str) -> asyncio.Task[Any]:
    sched = c.server.app[STATE_KEY].engine.scheduler
    task = asyncio.create_task(c.post("/generate", json={
        "text": "a long one", "rid": rid, "sampling_params": LONG_SP}))
    await wait_until(lambda: any(r.rid == rid for r in sched.running), f"{rid} running")
    return task


async def refused_409(resp: Any, rid: str) -> None:
    assert resp.status == 409, await resp.text()
    assert resp.headers["Content-Type"].startswith("application/json")
    assert repr(rid) in (await resp.json())["error"]


async def test_sixteen_requests_under_one_rid(aiohttp_client: Any) -> None:
    c = await aiohttp_client(create_app(EngineServerConfig()))
    sched = c.server.app[STATE_KEY].engine.scheduler
    first = await start_long(c, "same")
    [running] = sched.running
    table = list(running.table)
    refs = [sched.pool.refcount(p) for p in table]
    dups = await asyncio.gather(*(c.post("/generate", json={
        "text": f"dup {i}", "rid": "same", "stream": i % 2 == 1,
        "sampling_params": {"max_new_tokens": 4}}) for i in range(15)))
    for r in dups:
        await refused_409(r, "same")
    # the request already running is untouched: same pages, same references, nothing queued
    assert sched.running == [running] and running.table == table and not sched.waiting
    assert [sched.pool.refcount(p) for p in table] == refs
    assert sched.totals["requests"] == 1
    assert (await (await c.post("/abort_request", json={"rid": "same"})).json())["aborted"]
    assert (await (await first).json())["meta_info"]["finish_reason"]["type"] == "abort"
    await wait_until(lambda: sched.pool.total_refs == 0, "pages released")
    assert_idle(sched)
    again = await c.post("/generate", json={"text": "now free", "rid": "same",
                                            "sampling_params": {"max_new_tokens": 3}})
    assert again.status == 200 and (await again.json())["meta_info"]["id"] == "same"
    assert_idle(sched)


async def test_a_batch_is_refused_whole(aiohttp_client: Any) -> None:
    c = await aiohttp_client(create_app(EngineServerConfig()))
    sched = c.server.app[STATE_KEY].engine.scheduler
    sp = {"max_new_tokens": 3, "temperature": 0}
    twice = await c.post("/generate", json={"text": ["a", "b", "c"], "rid": ["x", "y", "x"],
                                            "sampling_params": sp})
    await refused_409(twice, "x")
    assert "twice" in (await twice.json())["error"] and sched.totals["requests"] == 0
    assert_idle(sched)
    first = await start_long(c, "busy")
    clash = await c.post("/generate", json={"text": ["a", "b", "c"],
                                            "rid": ["p", "busy", "q"], "sampling_params": sp})
    await refused_409(clash, "busy")
    assert sched.totals["requests"] == 1 and len(sched.running) == 1  # no item started
    await c.post("/abort_request", json={"rid": "busy"})
    await first
    await wait_until(lambda: sched.pool.total_refs == 0, "pages released")
    assert_idle(sched)
    ok = await c.post("/generate", json={"text": ["a", "b"], "rid": ["p", "busy"],
                                         "sampling_params": sp})
    assert ok.status == 200 and [d["meta_info"]["id"] for d in await ok.json()] == ["p", "busy"]
    assert_idle(sched)


async def test_an_id_is_free_only_once_its_abort_is_done() -> None:
    """An abandoned request's abort-by-id must find that request, never a newcomer under the
    same id queued in the meantime."""
    engine = AsyncEngine(build_scheduler(get_model_config("tiny"), num_pages=256))
    sched = engine.scheduler
    await engine.start()
    try:
        gen_a = engine.generate([256, *b"the first"], greedy(1000), "x")
        await anext(gen_a)
        closing = asyncio.create_task(gen_a.aclose())  # the client of A went away
        await asyncio.sleep(0)  # A's cleanup has begun; its abort is not done yet
        with pytest.raises(DuplicateRequest, match="'x'"):
            await anext(engine.generate([256, *b"the second"], greedy(4), "x"))
        await closing
        assert not sched.running and not sched.waiting
        outs = [out async for out in engine.generate([256, *b"the second"], greedy(4), "x")]
        assert outs[-1].finish_reason == {"type": "length", "length": 4}
        assert sched.totals["aborted"] == 1
        assert_idle(sched)
    finally:
        await engine.stop()


async def test_the_pool_is_at_rest_after_refused_aborted_and_failed_requests(
        aiohttp_client: Any) -> None:
    c = await aiohttp_client(create_app(EngineServerConfig(num_pages=100)))
    sched = c.server.app[STATE_KEY].engine.scheduler
    sp = {"max_new_tokens": 3, "temperature": 0}
    bad: list[tuple[dict[str, Any], int]] = [
        ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400),
        ({"input_ids": [256] * 1000, "sampling_params": {"max_new_tokens": 1000}}, 503),
        ({"text": ["a", "b"], "rid": ["r", "r"], "sampling_params": sp}, 409),
    ]
    for body, status in bad:
        r = await c.post("/generate", json=body)
        assert r.status == status, await r.text()
        assert_idle(sched)
    first = await start_long(c, "held")
    r = await c.post("/generate", json={"text": "y", "rid": "held", "sampling_params": sp})
    await refused_409(r, "held")
    await c.post("/abort_request", json={"rid": "held"})
    await first
    await wait_until(lambda: sched.pool.total_refs == 0, "the aborted request's pages freed")
    assert_idle(sched)
    # a stream whose client leaves mid-way
    async with c.post("/generate", json={"text": "streamed", "rid": "gone", "stream": True,
                                         "sampling_params": LONG_SP}) as resp:
        assert resp.status == 200
        await resp.content.readline()
    await wait_until(lambda: not sched.running and sched.pool.total_refs == 0,
                     "the abandoned stream aborted")
    assert_idle(sched)
    r = await c.post("/generate", json={"text": "after all that", "rid": "gone",
                                        "sampling_params": sp})
    assert r.status == 200
    assert_idle(sched)
