"""Admission control (--max-concurrent-requests, --queue-size, --queue-timeout-secs): slots,
a FIFO queue, 429 when it is full, 408 after waiting too long, and no slot ever lost."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.admission import Admission
from router.errors import Overloaded


async def test_slots_then_fifo_queue_then_429() -> None:
    adm = Admission(2, 2, 5.0)
    await adm.enter()
    await adm.enter()
    order: list[int] = []

    async def waiter(i: int) -> None:
        await adm.enter()
        order.append(i)

    waiting = [asyncio.create_task(waiter(i)) for i in range(2)]
    await asyncio.sleep(0.01)
    assert adm.queued == 2 and not order
    with pytest.raises(Overloaded) as info:
        await adm.enter()
    assert info.value.status == 429 and "--queue-size 2" in str(info.value)
    adm.leave()
    await asyncio.sleep(0.01)
    assert order == [0] and adm.in_flight == 2  # the slot was handed over, not freed
    adm.leave()
    await asyncio.gather(*waiting)
    assert order == [0, 1]
    for _ in range(2):
        adm.leave()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_waiting_too_long_is_408_and_frees_its_place() -> None:
    adm = Admission(1, 1, 0.05)
    await adm.enter()
    with pytest.raises(Overloaded) as info:
        await adm.enter()
    assert info.value.status == 408 and "0.05 s" in str(info.value)
    assert adm.queued == 0
    adm.leave()
    assert adm.in_flight == 0


async def test_a_cancelled_waiter_loses_no_slot() -> None:
    adm = Admission(1, 4, 5.0)
    await adm.enter()
    task = asyncio.create_task(adm.enter())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    adm.leave()
    assert adm.in_flight == 0
    # Handed over at the very moment its waiter is cancelled: the slot passes on.
    await adm.enter()
    first = asyncio.create_task(adm.enter())
    second = asyncio.create_task(adm.enter())
    await asyncio.sleep(0.01)
    adm.leave()  # hands the slot to `first`...
    first.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # so `second` got it
    adm.leave()
    assert adm.in_flight == 0 and adm.queued == 0


async def test_through_the_router(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.delay = 0.4
    client = await make_router([p], [d], model="tiny", max_concurrent_requests=1,
                               queue_size=1, queue_timeout=5.0)

    async def post() -> tuple[int, Any]:
        resp = await client.post("/generate", json={"text": "x"})
        return resp.status, await resp.json()

    first = asyncio.create_task(post())
    while not d.bodies:
        await asyncio.sleep(0.01)
    second = asyncio.create_task(post())  # queued behind the first
    while client.app.admission.queued < 1:
        await asyncio.sleep(0.005)
    status, body = await post()  # the queue is full
    assert status == 429 and "--max-concurrent-requests 1" in body["error"]
    assert [(await t)[0] for t in (first, second)] == [200, 200]
    assert len(d.bodies) == 2 and client.app.admission.in_flight == 0
    # Health and metrics never queue behind requests.
    assert (await client.get("/health")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_requests_total{route="/generate",status="429"} 1.0' in metrics


async def test_unlimited_by_default(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.delay = 0.1
    client = await make_router([p], [d], model="tiny")
    async with asyncio.timeout(5):
        statuses = await asyncio.gather(*(client.post("/generate", json={"text": "x"})
                                          for _ in range(20)))
    assert [r.status for r in statuses] == [200] * 20
    assert client.app.admission.in_flight == 0  # nothing is counted without a limit
