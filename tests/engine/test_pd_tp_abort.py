"""A prefill with TP > 1 that gives a room up (its client hung up, or its own send failed) has
every rank abort it at once: a follower would otherwise keep the room open and send pages the
leader had just freed, until its own timeout. The follower's engine thread waits for the abort
to run in its event loop before the next replicated call (the one giving the pages back)."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import torch
from pd_helpers import monolithic, pd_body
from pd_procs import assert_at_rest, proc_pair

from bootstrap.client import BootstrapClient, BootstrapClientConfig
from engine.config import get_model_config
from engine.ranks.replica import loop_handoff
from transfer import KVLayout, TransferConfig, create_receiver

IDS = [256, *b"a prompt whose client hangs up while the prefill ranks send it"]
# far past the test's deadlines: a room that fails on a follower is the abort's doing
PATIENT = ("--transfer-bootstrap-timeout", "300", "--transfer-waiting-timeout", "300")


@pytest.fixture
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        async def cancel_all() -> None:
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_an_abort_has_run_when_the_handoff_returns(loop_thread: asyncio.AbstractEventLoop
                                                   ) -> None:
    """The engine thread's next call frees the room's pages: the abort must have run by then,
    and after the send it ends (tasks start in the order of their ops)."""
    seen: list[tuple[Any, ...]] = []

    async def handler(op: tuple[Any, ...]) -> None:
        seen.append(op)
        if op[0] == "send":
            await asyncio.sleep(3600)  # a send waits on its decode

    hand = loop_handoff(loop_thread, handler)
    hand(("send", 7))
    hand(("abort", 7, "the client left"))
    assert seen == [("send", 7), ("abort", 7, "the client left")]


async def debug_pd(s: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with s.get(url + "/debug/pd") as r:
        return await r.json()  # type: ignore[no-any-return]


async def until_debug(s: aiohttp.ClientSession, url: str, what: str,
                      cond: Any, timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not cond(doc := await debug_pd(s, url)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {doc}"
        await asyncio.sleep(0.05)
    return doc


async def ask_the_leader_only(bport: int, room: int) -> contextlib.AsyncExitStack:
    """A decode rank (rank 0 of a TP 2 decode, which reads prefill rank 0 alone) that asks for
    ``room`` and takes its KV; the prefill computes the room once it asked, and the follower
    then waits in Bootstrapping for a decode rank 1 that never comes."""
    stack = contextlib.AsyncExitStack()
    client = BootstrapClient(BootstrapClientConfig())
    await client.start()
    stack.push_async_callback(client.close)
    leader = await client.get_rank_address("127.0.0.1", bport, 0, 0, 0, 0)
    m = get_model_config("tiny")
    layout = KVLayout.for_tp(num_layers=m.num_layers, num_heads=m.num_kv_heads,
                             head_dim=m.head_dim, page_size=16, dtype=m.dtype, tp_size=2)
    pages = -(-len(IDS) // 16)
    pool = torch.zeros(m.num_layers, 2, pages, 16, m.num_kv_heads // 2, m.head_dim,
                       dtype=getattr(torch, m.dtype))
    receiver = create_receiver("zmq", TransferConfig(), layout, pool)
    await receiver.start()
    stack.push_async_callback(receiver.close)
    await receiver.connect(leader.tcp_endpoint)
    task = asyncio.create_task(receiver.receive(room, [leader.tcp_endpoint], list(range(pages)),
                                                num_requesters=1))
    stack.push_async_callback(asyncio.gather, task, return_exceptions=True)
    return stack


@pytest.mark.timeout(180)
async def test_a_hang_up_aborts_the_room_on_every_prefill_rank() -> None:
    want = monolithic([IDS], [6])[0]
    with proc_pair(*PATIENT, prefill_extra=("--tp", "2")) as (prefill, decode):
        async with aiohttp.ClientSession() as s, contextlib.AsyncExitStack() as stack:
            body = {**pd_body(IDS, 6, prefill.bport), "rid": "abandoned"}
            pre = asyncio.create_task(s.post(prefill.url + "/generate", json=body))
            # only the leader's decode rank asks: the follower's send waits in Bootstrapping
            stack.push_async_callback(
                (await ask_the_leader_only(prefill.bport, body["bootstrap_room"])).aclose)
            await until_debug(s, prefill.url, "both ranks told to send",
                              lambda d: d["sending"] == 1)
            pre.cancel()  # the router's client hung up: the connection closes
            await asyncio.gather(pre, return_exceptions=True)
            doc = await until_debug(s, prefill.url, "the follower's room aborted",
                                    lambda d: d["ranks"].get("send_failed") == 1)
            assert doc["ranks"].get("send_ok", 0) == 0, doc
            await until_debug(s, prefill.url, "the pages given back",
                              lambda d: d["held"] == 0 and d["sending"] == 0)
            await assert_at_rest(s, prefill.url, decode.url)
            # the same prompt again: its pages (now cached) are the ones the follower held
            body = pd_body(IDS, 6, prefill.bport)
            pr, dr = await asyncio.gather(s.post(prefill.url + "/generate", json=body),
                                          s.post(decode.url + "/generate", json=body))
            pbody, dbody = await pr.json(), await dr.json()
            assert (pr.status, dr.status) == (200, 200), (pbody, dbody)
            assert dbody["output_ids"] == want
            doc = await debug_pd(s, prefill.url)
            assert doc["ranks"] == {"send_failed": 1, "send_ok": 1}, doc
            await assert_at_rest(s, prefill.url, decode.url)
