"""A client (the router, whose own client hung up) that closes its connection to a PD worker
aborts the request there, at whatever stage it is: a decode waiting for KV, decoding, or
streaming, and a prefill waiting for its decode. Every page comes back and the next request is
served. The in-process servers here use aiohttp's default runner, which does not cancel a
handler on disconnect (``kvatlas engine serve`` asks run_app to): the workers notice a hang-up
themselves, whoever serves their app."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import aiohttp
import pytest
from engine_helpers import assert_idle, wait_until
from pd_helpers import Pair, dual, fast_transfer, pd_body, start_pair
from pd_procs import assert_at_rest, internal_states, proc_pair

pytestmark = pytest.mark.timeout(120)
IDS = [256, *b"a prompt whose client will not wait for the answer"]
LONG = 1500
# far longer than any wait below: a page given back must be the hang-up's doing
PATIENT = fast_transfer(bootstrap_timeout_s=300.0, waiting_timeout_s=300.0)


@pytest.fixture
async def patient_pair() -> Any:
    p = await start_pair(decode_over={"transfer": PATIENT}, prefill_over={"transfer": PATIENT},
                         plain_runner=True)
    try:
        yield p
    finally:
        await p.decode.close()
        await p.prefill.close()


async def hang_up(task: asyncio.Task[Any]) -> None:
    """Drop a client request mid-way: aiohttp closes its connection."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url + "/generate", json=body) as r:
        return r.status, await r.read()


async def next_served(s: aiohttp.ClientSession, pair: Pair) -> None:
    assert_idle(pair.ps.replica)
    assert_idle(pair.ds.replica)
    (pstatus, _), (dstatus, dbody) = await dual(s, pair.p_url, pair.d_url,
                                                pd_body(IDS, 4, pair.bport))
    assert (pstatus, dstatus) == (200, 200) and len(dbody["output_ids"]) == 4
    assert_idle(pair.ps.replica)
    assert_idle(pair.ds.replica)


def decode_at_rest(pair: Pair) -> bool:
    ds = pair.ds.replica
    return not ds.running and ds.pool.num_free == ds.pool.num_pages


@pytest.mark.parametrize("stream", [False, True])
async def test_a_hang_up_while_decoding_aborts_it(patient_pair: Pair, stream: bool,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    pair = patient_pair
    async with aiohttp.ClientSession() as s:
        body = pd_body(IDS, LONG, pair.bport, stream=stream)
        prefill = asyncio.create_task(post(s, pair.p_url, body))
        decode = asyncio.create_task(post(s, pair.d_url, body))
        await wait_until(lambda: bool(pair.ds.replica.running), "the decode running")
        assert (await prefill)[0] == 200
        await hang_up(decode)
        room = body["bootstrap_room"]
        await wait_until(lambda: decode_at_rest(pair) and room not in pair.ds.rooms.active,
                         "the decode aborted")
        sched = pair.ds.replica
        assert sched.totals["aborted"] == 1 and sched.totals["generated_tokens"] < LONG
        await next_served(s, pair)
    # the client's event, not the worker's error: aiohttp logged a traceback for each stream a
    # client stopped, when a write to it raised
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_a_hang_up_while_the_decode_waits_for_kv(patient_pair: Pair) -> None:
    pair = patient_pair
    async with aiohttp.ClientSession() as s:
        body = pd_body(IDS, 8, pair.bport)
        decode = asyncio.create_task(post(s, pair.d_url, body))  # its prefill never comes
        await wait_until(lambda: pair.ds.replica.pool.num_free < pair.ds.replica.pool.num_pages,
                         "the decode holding its reservation")
        await hang_up(decode)
        room = body["bootstrap_room"]
        await wait_until(lambda: decode_at_rest(pair) and room not in pair.ds.rooms.active,
                         "the reservation given back")
        doc = pair.ds.rooms.get(room).doc()
        assert doc["state"] == "failed" and "cancelled" in doc["error"]["reason"], doc
        await next_served(s, pair)


async def test_a_cancel_as_the_reservation_is_made_gives_its_pages_back(patient_pair: Pair
                                                                        ) -> None:
    """The engine thread finishes a reservation whatever happens to the handler that asked for
    it: a cancellation (the client hung up) landing after the pages were taken but before the
    handler got them must still see them given back."""
    pair = patient_pair
    gate = threading.Event()
    # hold the engine thread so that the decode's reserve call waits in its queue
    blocker = asyncio.ensure_future(pair.ds.engine.call(gate.wait))
    try:
        async with aiohttp.ClientSession() as s:
            body = pd_body(IDS, 8, pair.bport)
            room = body["bootstrap_room"]
            decode = asyncio.create_task(post(s, pair.d_url, body))
            await wait_until(lambda: room in pair.ds.rooms.active, "the decode reserving")
            handler = next(t for t in asyncio.all_tasks()
                           if t.get_coro().__qualname__ == "decode_item")
            # No await from here to the cancel: the engine thread reserves while this loop is
            # held, and the cancellation lands before the answer is delivered to the handler.
            gate.set()
            deadline = time.monotonic() + 10
            while pair.ds.replica.pool.num_free == pair.ds.replica.pool.num_pages:
                assert time.monotonic() < deadline, "the engine thread never reserved"
                time.sleep(0.01)
            handler.cancel()
            await blocker
            await hang_up(decode)
            await wait_until(lambda: room not in pair.ds.rooms.active, "the cancel noticed")
            await wait_until(lambda: decode_at_rest(pair), "the reservation given back", 10.0)
            await next_served(s, pair)
    finally:
        gate.set()


async def test_a_hang_up_while_the_prefill_waits_for_its_decode(patient_pair: Pair) -> None:
    pair = patient_pair
    ps = pair.ps.replica
    async with aiohttp.ClientSession() as s:
        body = {**pd_body(IDS, 8, pair.bport), "rid": "waiting"}
        prefill = asyncio.create_task(post(s, pair.p_url, body))  # its decode never comes
        room = body["bootstrap_room"]
        await wait_until(lambda: room in pair.ps.awaiting_decode, "the prefill waiting")
        assert not ps.held and ps.cache.pages_in_use == 0, "it holds pages before its decode"
        await hang_up(prefill)
        await wait_until(lambda: room not in pair.ps.awaiting_decode, "the wait abandoned")
        assert pair.ps.sender.poll(room).name == "FAILED"
        assert ps.totals["requests"] == 0, "the prompt ran without a decode"
        await next_served(s, pair)


async def test_a_hang_up_mid_stream_on_real_processes() -> None:
    """The same through `kvatlas engine serve` processes (aiohttp's run_app)."""
    with proc_pair() as (prefill, decode):
        async with aiohttp.ClientSession() as s:
            body = pd_body(IDS, LONG, prefill.bport, stream=True)
            pre = asyncio.create_task(post(s, prefill.url, body))
            async with s.post(decode.url + "/generate", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first token arrived
                resp.close()
            assert (await pre)[0] == 200
            while (await internal_states(s, decode.url))["running"]:
                await asyncio.sleep(0.05)
            await assert_at_rest(s, prefill.url, decode.url)
            (pstatus, _), (dstatus, dbody) = await dual(s, prefill.url, decode.url,
                                                        pd_body(IDS, 4, prefill.bport))
            assert (pstatus, dstatus) == (200, 200) and len(dbody["output_ids"]) == 4
            await assert_at_rest(s, prefill.url, decode.url)
