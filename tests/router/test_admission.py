"""Admission control (--max-concurrent-requests, --queue-size, --queue-timeout-secs): slots,
a FIFO queue, 429 when it is full, 408 after waiting too long, and no slot ever lost.

Per-worker admission (router/capacity.py): a worker never gets more than the requests and KV
pages it states; the rest wait at the router (429 with Retry-After past --worker-queue-size)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from router_stubs import StubWorker

from index.record import InstanceRecord
from router.admission import Admission
from router.capacity import Bound, Capacity, NoRoom, stated_bound
from router.config import RouterConfig
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
    resp = await client.post("/generate", json={"text": "x"})  # the queue is full
    body = await resp.json()
    assert resp.status == 429 and "--max-concurrent-requests 1" in body["error"]
    assert resp.headers["Retry-After"] == "1" and body["retry_after_s"] == 1
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


# --- per-worker admission (router/capacity.py) ---------------------------------------------

class CountingStub(StubWorker):
    """A stub that keeps the largest number of requests it ever served at once."""

    def __init__(self, role: str, name: str | None = None) -> None:
        super().__init__(role, name)
        self.active = 0
        self.peak = 0

    async def _answer(self, request: Any, body: dict[str, Any]) -> Any:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super()._answer(request, body)
        finally:
            self.active -= 1


@pytest.fixture
async def counting() -> AsyncIterator[Callable[[str, dict[str, Any] | None],
                                             Awaitable[CountingStub]]]:
    started: list[CountingStub] = []

    async def make(role: str, info: dict[str, Any] | None) -> CountingStub:
        stub = await CountingStub(role).start()
        stub.server_info = info
        started.append(stub)
        return stub

    yield make
    for s in started:
        await s.stop()


async def eventually(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Until ``cond()`` holds; fails saying ``what`` never happened."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.005)


async def bounded_router(make_router: Any, p: StubWorker, d: StubWorker,
                         **kw: Any) -> Any:
    """A router in front of ``p`` and ``d`` once it knows what both state (/server_info)."""
    client = await make_router([p], [d], model="tiny", **kw)
    cap = client.app.state.capacity
    await eventually(lambda: len(cap.bounds) == 2, "the router read both workers' capacity")
    return client


def gen(tokens: int = 10, new: int = 8) -> dict[str, Any]:
    return {"input_ids": [1] * tokens, "sampling_params": {"max_new_tokens": new}}


async def test_a_burst_waits_at_the_router_and_workers_never_see_more_than_they_state(
        counting: Any, make_router: Any) -> None:
    p = await counting("prefill", {"max_running_requests": 2})
    d = await counting("decode", {"max_running_requests": 3})
    d.hold = asyncio.Event()
    client = await bounded_router(make_router, p, d)
    cap = client.app.state.capacity
    burst = [asyncio.create_task(client.post("/generate", json=gen())) for _ in range(12)]
    # Held at the decode: 3 in flight there, the other 9 wait at the router.
    await eventually(lambda: d.active == 3 and cap.queued == 9,
                     "3 requests at the decode and 9 queued at the router")
    assert d.peak == 3 and p.peak <= 2
    d.hold.set()
    answers = await asyncio.gather(*burst)
    assert [r.status for r in answers] == [200] * 12
    assert d.peak == 3 and p.peak <= 2 and len(d.bodies) == 12
    assert cap.queued == 0 and not cap.pages


async def test_kv_pages_bound_what_a_decode_holds(counting: Any, make_router: Any) -> None:
    # 64 pages of 16 tokens; each request needs ceil((200 + 56) / 16) = 16 pages there.
    p = await counting("prefill", None)
    d = await counting("decode", {"max_total_num_tokens": 64 * 16, "page_size": 16,
                                  "max_running_requests": 100})
    d.hold = asyncio.Event()
    client = await make_router([p], [d], model="tiny")
    cap = client.app.state.capacity
    await eventually(lambda: any(b.pages == 64 for b in cap.bounds.values()),
                     "the router read the decode's capacity")
    burst = [asyncio.create_task(client.post("/generate", json=gen(200, 56)))
             for _ in range(6)]
    await eventually(lambda: d.active == 4 and cap.queued == 2,
                     "4 requests (64 pages) at the decode and 2 queued")
    assert sum(cap.pages.values()) == 64
    d.hold.set()
    assert [r.status for r in await asyncio.gather(*burst)] == [200] * 6
    assert d.peak == 4 and not cap.pages


async def test_a_full_queue_is_429_with_retry_after(counting: Any, make_router: Any) -> None:
    p = await counting("prefill", {"max_running_requests": 1})
    d = await counting("decode", {"max_running_requests": 1})
    d.hold = asyncio.Event()
    client = await bounded_router(make_router, p, d, worker_queue_size=2)
    cap = client.app.state.capacity
    held = [asyncio.create_task(client.post("/generate", json=gen())) for _ in range(3)]
    await eventually(lambda: d.active == 1 and cap.queued == 2, "1 in flight, 2 queued")
    resp = await client.post("/generate", json=gen(), headers={"x-request-id": "late-1"})
    body = await resp.json()
    assert resp.status == 429
    assert int(resp.headers["Retry-After"]) >= 1
    assert body["retry_after_s"] == int(resp.headers["Retry-After"])
    assert "--worker-queue-size 2" in body["error"]
    assert resp.headers["x-request-id"] == "late-1"
    assert len(d.bodies) == 1  # the refused request reached no worker
    d.hold.set()
    assert [r.status for r in await asyncio.gather(*held)] == [200] * 3


async def test_a_queued_request_proceeds_when_capacity_frees(counting: Any,
                                                              make_router: Any) -> None:
    p = await counting("prefill", {"max_running_requests": 1})
    d = await counting("decode", {"max_running_requests": 1})
    d.hold = asyncio.Event()
    client = await bounded_router(make_router, p, d)
    cap = client.app.state.capacity
    first = asyncio.create_task(client.post("/generate", json=gen()))
    await eventually(lambda: d.active == 1, "the first request at the decode")
    second = asyncio.create_task(client.post("/generate", json=gen()))
    await eventually(lambda: cap.queued == 1, "the second request queued at the router")
    assert len(d.bodies) == 1
    d.hold.set()  # the first one finishes: its place at the decode goes to the second
    assert [(await t).status for t in (first, second)] == [200, 200]
    assert len(d.bodies) == 2 and d.peak == 1 and cap.queued == 0


async def test_waiting_too_long_for_room_is_408(counting: Any, make_router: Any) -> None:
    p = await counting("prefill", {"max_running_requests": 1})
    d = await counting("decode", {"max_running_requests": 1})
    d.hold = asyncio.Event()
    client = await bounded_router(make_router, p, d, worker_queue_timeout=0.05)
    first = asyncio.create_task(client.post("/generate", json=gen()))
    await eventually(lambda: d.active == 1, "the first request at the decode")
    resp = await client.post("/generate", json=gen())
    assert resp.status == 408 and "Retry-After" in resp.headers
    assert "--worker-queue-timeout-secs" in (await resp.json())["error"]
    assert client.app.state.capacity.queued == 0
    d.hold.set()
    assert (await first).status == 200


async def test_no_worker_admission_forwards_everything(counting: Any, make_router: Any) -> None:
    p = await counting("prefill", {"max_running_requests": 1})
    d = await counting("decode", {"max_running_requests": 1})
    d.hold = asyncio.Event()
    client = await make_router([p], [d], model="tiny", worker_admission=False)
    burst = [asyncio.create_task(client.post("/generate", json=gen())) for _ in range(4)]
    await eventually(lambda: d.active == 4, "all 4 requests at the decode at once")
    d.hold.set()
    assert [r.status for r in await asyncio.gather(*burst)] == [200] * 4


async def test_an_etcd_record_states_the_bound(etcd_settings: Any, key_prefix: str,
                                               start_router: Any, register: Any) -> None:
    p, d = await CountingStub("prefill").start(), await CountingStub("decode").start()
    try:
        d.hold = asyncio.Event()
        await register("pre", {"role": "prefill", "model": "tiny", "url": p.url})
        await register("dec", {"role": "decode", "model": "tiny", "url": d.url,
                               "max_running_requests": 2, "page_size": 16,
                               "max_total_num_tokens": 4096})
        client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                                 model="tiny", health_interval=60.0,
                                                 tokenizers={None: "byte"}))
        cap = client.app.state.capacity
        await eventually(lambda: cap.bounds.get("dec") == Bound(2, 256, 16),
                         "the decode's record read as 2 requests and 256 pages")
        burst = [asyncio.create_task(client.post("/generate", json=gen())) for _ in range(3)]
        await eventually(lambda: d.active == 2 and cap.queued == 1, "2 at the decode, 1 queued")
        d.hold.set()
        assert [r.status for r in await asyncio.gather(*burst)] == [200] * 3
        assert d.peak == 2
    finally:
        await p.stop()
        await d.stop()


def test_the_record_carries_what_an_engine_holds() -> None:
    rec = InstanceRecord(instance_id="dec", role="decode", page_size=16,
                         max_running_requests=8, max_total_num_tokens=1024)
    back = InstanceRecord.from_json(rec.to_json())
    assert (back.max_running_requests, back.max_total_num_tokens) == (8, 1024)
    assert stated_bound(back.to_dict()) == Bound(8, 64, 16)
    assert stated_bound({"max_running_requests": True, "page_size": 16}) is None


async def test_a_queue_that_would_not_drain_in_time_is_429_at_once() -> None:
    now = [100.0]
    cap = Capacity(True, queue_size=1000, queue_timeout=20.0, clock=lambda: now[0])

    def no_room() -> None:
        raise NoRoom("decode")

    for _ in range(5):  # 5 requests finished just now: about 1 a second (RATE_WINDOW 5 s)
        cap.give(None, 0, finished=True)
    waiting = [asyncio.create_task(cap.admit(no_room)) for _ in range(10)]
    # 10 s at 1 a second: within half the 20 s timeout, so they queue
    await eventually(lambda: cap.queued == 10, "10 requests queued (10 s at 1 a second)")
    with pytest.raises(Overloaded) as info:
        await cap.admit(no_room)  # the 11th would wait ~11 s, past half the 20 s timeout
    assert info.value.status == 429 and info.value.retry_after == 11
    assert "half of router --worker-queue-timeout-secs 20" in str(info.value)
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert cap.queued == 0  # cancelled waiters leave the queue
    now[0] += 6.0  # nothing finished for longer than RATE_WINDOW: no rate to judge by
    late = asyncio.create_task(cap.admit(no_room))
    await eventually(lambda: cap.queued == 1, "a request queued after a quiet spell")
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
