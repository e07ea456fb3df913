"""A client that hangs up is a client event: both workers' requests are abandoned (so that the
engines abort them) and no worker's circuit breaker hears of it."""
from __future__ import annotations

import asyncio
from typing import Any


async def test_hung_up_streams_abort_both_workers_and_spare_the_breaker(
        stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.hold = asyncio.Event()  # the prefill is still at work when the client leaves
    d.release_stream = asyncio.Event()  # the decode streams one event, then waits
    client = await make_router([p], [d])
    for i in range(20):
        resp = await client.post("/generate", json={"text": f"stop me {i}", "stream": True})
        assert resp.status == 200
        assert (await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)).startswith(b"data:")
        resp.close()  # the user pressed "stop"
        await asyncio.wait_for(d.wait_cancelled(i + 1), 10)
        await asyncio.wait_for(p.wait_cancelled(i + 1), 10)
    p.hold.set()
    d.release_stream.set()
    resp = await client.post("/generate", json={"text": "served"})
    assert resp.status == 200 and (await resp.json())["worker"] == "decode0"
    workers = await (await client.get("/workers")).json()
    assert workers["decode"][0]["circuit"] == "closed"
    assert workers["prefill"][0]["circuit"] == "closed"
    assert [w["load"] for role in ("prefill", "decode") for w in workers[role]] == [0, 0]
    assert await client.metric_lines("kvatlas_router_upstream_errors_total") == []
    assert await client.metric_lines("kvatlas_router_client_disconnects_total") == [
        'kvatlas_router_client_disconnects_total{route="/generate"} 20.0']


async def test_a_hang_up_before_the_answer_aborts_both_workers(stubs: Any,
                                                              make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.hold = asyncio.Event()
    d.hold = asyncio.Event()
    client = await make_router([p], [d], breaker_failure_threshold=2)
    for i in range(3):
        pending = asyncio.ensure_future(client.post("/v1/completions",
                                                    json={"prompt": f"never mind {i}"}))
        while len(d.bodies) <= i or len(p.bodies) <= i:
            await asyncio.sleep(0.01)  # until both workers have the request
        pending.cancel()  # the client's connection closes with it
        await asyncio.wait_for(d.wait_cancelled(i + 1), 10)
        await asyncio.wait_for(p.wait_cancelled(i + 1), 10)
    p.hold.set()
    d.hold.set()
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
    workers = await (await client.get("/workers")).json()
    assert workers["decode"][0]["circuit"] == "closed"
    assert await client.metric_lines("kvatlas_router_upstream_errors_total") == []
    assert await client.metric_lines("kvatlas_router_client_disconnects_total") == [
        'kvatlas_router_client_disconnects_total{route="/v1/completions"} 3.0']
