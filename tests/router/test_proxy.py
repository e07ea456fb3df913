"""The request path through a real router in front of real stub workers."""
from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import aiohttp
import pytest
from router_stubs import router_config
from waiting import wait_until

from router.app import create_app
from router.rooms import MAX_ROOM


async def test_generate_goes_to_both_with_injected_bootstrap(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "hello world", "sampling_params":
                                                {"max_new_tokens": 4}})
    assert resp.status == 200
    body = await resp.json()
    assert body["worker"] == "decode0"  # the client gets the decode's answer
    assert len(p.bodies) == len(d.bodies) == 1
    pb, db = p.bodies[0], d.bodies[0]
    assert pb == db  # the same body went to both
    assert pb["bootstrap_host"] == "127.0.0.1"
    assert pb["bootstrap_port"] is None  # static prefill without a port: the prefill's default
    assert 1 <= pb["bootstrap_room"] <= MAX_ROOM
    assert pb["text"] == "hello world" and pb["sampling_params"] == {"max_new_tokens": 4}


async def test_client_bootstrap_fields_are_replaced(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "bootstrap_room": 7,
                                                "bootstrap_host": "evil"})
    assert resp.status == 200
    assert d.bodies[0]["bootstrap_room"] != 7 and d.bodies[0]["bootstrap_host"] == "127.0.0.1"
    raw = b'{"text": "spliced", "sampling_params": {"max_new_tokens": 2}}  \n'
    resp = await client.post("/generate", data=raw)
    assert resp.status == 200
    assert d.bodies[1]["text"] == "spliced" and d.bodies[1]["bootstrap_room"] == p.bodies[1][
        "bootstrap_room"] and d.bodies[1]["sampling_params"] == {"max_new_tokens": 2}


async def test_batch_gets_lists_with_distinct_rooms(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": ["a", "b", "c", "d"]})
    assert resp.status == 200
    b = d.bodies[0]
    assert b["bootstrap_host"] == ["127.0.0.1"] * 4 and b["bootstrap_port"] == [None] * 4
    assert len(set(b["bootstrap_room"])) == 4
    resp = await client.post("/generate", json={"input_ids": [[1, 2], [3, 4]]})
    assert resp.status == 200 and len(set(d.bodies[1]["bootstrap_room"])) == 2


async def test_static_bootstrap_port_is_injected(stubs: Any, start_router: Any) -> None:
    from router.config import RouterConfig
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(RouterConfig(prefill=[(p.url, "9123")], decode=[d.url]))
    assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
    assert d.bodies[0]["bootstrap_port"] == 9123


async def test_headers_forwarded_and_request_id(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    resp = await client.post("/v1/chat/completions", headers={
        "authorization": "Bearer user-key", "cookie": "session=abc", "traceparent": tp,
        "x-request-id": "req-42"},
        json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.status == 200 and resp.headers["x-request-id"] == "req-42"
    for stub in (p, d):
        h = {k.lower(): v for k, v in stub.headers[0].items()}
        # The client's credentials stay at the router: a worker is whatever an etcd record
        # names, and a forged record must not collect them.
        assert "authorization" not in h and "cookie" not in h, h
        assert h["traceparent"] == tp and h["x-request-id"] == "req-42"
    resp = await client.post("/generate", json={"text": "x"})
    rid = resp.headers["x-request-id"]
    assert len(rid) >= 16
    assert {k.lower(): v for k, v in d.headers[1].items()}["x-request-id"] == rid


async def test_client_credentials_forwarded_only_when_asked(stubs: Any,
                                                             make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], forward_client_auth=True)
    resp = await client.post("/generate", json={"text": "x"}, headers={
        "authorization": "Bearer user-key", "cookie": "session=abc"})
    assert resp.status == 200
    for stub in (p, d):
        h = {k.lower(): v for k, v in stub.headers[0].items()}
        assert h["authorization"] == "Bearer user-key" and h["cookie"] == "session=abc", h


async def test_request_id_from_the_configured_headers(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], request_id_headers=("X-Trace-Id", "x-request-id"))
    resp = await client.post("/generate", json={"text": "x"},
                             headers={"x-request-id": "second", "x-trace-id": "first"})
    assert resp.headers["x-request-id"] == "first"
    assert {k.lower(): v for k, v in d.headers[0].items()}["x-request-id"] == "first"
    resp = await client.post("/generate", json={"text": "x"}, headers={"x-request-id": "only"})
    assert resp.headers["x-request-id"] == "only"


async def test_retry_draws_new_room_each_attempt(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [503, 500]
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "retry me"})
    assert resp.status == 200
    assert len(d.bodies) == 3 and len(p.bodies) == 3
    assert len(set(d.rooms)) == 3 and d.rooms == p.rooms
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_retries_total{route="/generate"} 2.0' in metrics


async def test_retries_stop_after_max_attempts(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [429] * 10
    client = await make_router([p], [d], retry_max_attempts=3)
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 429 and len(d.bodies) == 3
    assert "scripted 429" in (await resp.json())["error"]
    # 429 is a client-class answer: it never counts against the breaker.
    workers = await (await client.get("/workers")).json()
    assert workers["decode"][0]["circuit"] == "closed"


async def test_non_retryable_4xx_passes_through(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [400]
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 400 and len(d.bodies) == 1


async def test_prefill_failure_is_502_and_blamed_on_prefill(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.statuses = [500] * 10
    d.delay = 0.3  # a real decode waits for the KV
    client = await make_router([p], [d], retry_max_attempts=2)
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 502
    assert "prefill" in (await resp.json())["error"]
    workers = await (await client.get("/workers")).json()
    pw, dw = workers["prefill"][0], workers["decode"][0]
    assert pw["load"] == 0 and dw["load"] == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_upstream_errors_total{reason="500",role="prefill"} 2.0' in metrics
    assert 'role="decode"' not in metrics.split("kvatlas_router_upstream_errors_total")[1] \
        .split("# HELP")[0]


async def test_retry_moves_to_another_prefill(stubs: Any, make_router: Any) -> None:
    prefills, (d,) = await stubs("prefill", 2), await stubs("decode")
    prefills[0].statuses = [500] * 100
    client = await make_router(prefills, [d], policy="random")
    for _ in range(5):
        resp = await client.post("/generate", json={"text": "x"})
        assert resp.status == 200
    # A failed prefill is avoided on the next attempt of the same request.
    assert len(prefills[1].bodies) == 5 and len(prefills[0].bodies) <= 5


async def test_transport_error_is_retried_elsewhere(stubs: Any, make_router: Any) -> None:
    (p,), decodes = await stubs("prefill"), await stubs("decode", 2)
    client = await make_router([p], decodes)
    await decodes[0].stop()
    for _ in range(6):
        resp = await client.post("/generate", json={"text": "x"})
        assert resp.status == 200
        assert (await resp.json())["worker"] == "decode1"


async def test_streaming_is_passed_through_unbuffered(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.release_stream = asyncio.Event()
    client = await make_router([p], [d])
    resp = await client.post("/v1/completions", json={"prompt": "stream", "stream": True})
    assert resp.status == 200 and resp.headers["content-type"].startswith("text/event-stream")
    # The first event reaches the client while the decode is still holding the rest back.
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert json.loads(first[len(b"data: "):])["text"] == "tok0"
    d.release_stream.set()
    rest = await resp.content.read()
    assert rest.count(b"data: ") == 3 and rest.endswith(b"data: [DONE]\n\n")


async def test_a_prefill_stops_counting_as_loaded_at_the_decodes_first_byte(
        stubs: Any, make_router: Any) -> None:
    # A prefill's call may stay open past its work (until the KV send is acknowledged, past
    # the end of a short stream); the decode's first byte proves the KV arrived, so a
    # conversation's next turn must not see the prefix's holder as still busy.
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.hold = asyncio.Event()
    d.release_stream = asyncio.Event()
    client = await make_router([p], [d])

    async def loads() -> list[int]:
        workers = await (await client.get("/workers")).json()
        return [workers[role][0]["load"] for role in ("prefill", "decode")]

    resp = await client.post("/generate", json={"text": "turn one", "stream": True})
    assert resp.status == 200
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert await loads() == [0, 1]  # the prefill's call is still held open
    d.release_stream.set()
    await resp.read()
    # the decode's count drops once the router has relayed the stream's end, which the
    # client may read first
    last: list[int] = []

    async def idle() -> bool:
        last[:] = await loads()
        return last == [0, 0]

    await wait_until(idle, what="both loads back to 0 once the stream ended", detail=lambda: last)
    p.hold.set()  # its call ends now: counted off once, not twice

    async def prefill_call_ended() -> bool:
        return await client.metric_lines(
            'kvatlas_router_upstream_latency_seconds_count{role="prefill"}') == [
            'kvatlas_router_upstream_latency_seconds_count{role="prefill"} 1.0']

    await wait_until(prefill_call_ended, what="the router saw the held prefill's call end")
    assert await loads() == [0, 0]
    resp = await client.post("/generate", json={"text": "turn two"})
    assert resp.status == 200 and await loads() == [0, 0]


async def test_stream_error_before_first_byte_is_retried(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [503]
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "stream": True})
    assert resp.status == 200
    assert (await resp.content.read()).endswith(b"data: [DONE]\n\n")
    assert len(d.bodies) == 2 and d.rooms[0] != d.rooms[1]


class _SplitDecode:
    """A decode that refuses every /generate with ``status``, its head and its body sent in
    two writes 0.1 s apart, as a server that flushes its head first may (the router reads them
    in two reads). GETs (the health checks) get a 200 or 404."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body
        self.refused = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""

    async def start(self) -> _SplitDecode:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if line)
                length = {k.strip().lower(): v for k, v in fields.items()}.get(b"content-length")
                await reader.readexactly(int(length or 0))
                if head.startswith(b"GET"):
                    code = 200 if head.startswith(b"GET /health ") else 404
                    writer.write(b"HTTP/1.1 %d X\r\ncontent-length: 2\r\n\r\n{}" % code)
                    continue
                self.refused += 1
                writer.write(b"HTTP/1.1 %d Refused\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % (self.status, len(self.body)))
                await writer.drain()
                # A slow peer on purpose (what this stub is for): the body comes apart from
                # the head, so the router reads them in two reads.
                await asyncio.sleep(0.1)
                writer.write(self.body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.mark.parametrize("status", [400, 503])
async def test_a_streamed_requests_error_reaches_the_client_whole(stubs: Any, make_router: Any,
                                                                  status: int) -> None:
    """A streamed call resolves at the answer's head; an error answer is not streamed to the
    client but returned (or retried, then returned) whole, so its body must be read to its end,
    not taken as far as it had arrived with the head."""
    (p,) = await stubs("prefill")
    error = json.dumps({"error": "the decode refuses: " + "why " * 200}).encode()
    d = await _SplitDecode(status, error).start()
    try:
        client = await make_router([p], [d], retry_max_attempts=2)
        resp = await client.post("/generate", json={"text": "x", "stream": True})
        assert resp.status == status
        assert await resp.read() == error
        assert d.refused == (2 if status == 503 else 1)
    finally:
        await d.stop()


async def test_503_when_nothing_can_be_selected(stubs: Any, make_router: Any) -> None:
    (p,) = await stubs("prefill")
    client = await make_router([p], [])
    resp = await client.post("/generate", json={"text": "x"})
    assert resp.status == 503
    body = await resp.json()
    assert "no decode workers" in body["error"] and body["role"] == "decode"
    assert not p.bodies
    ready = await client.get("/readiness")
    assert ready.status == 503
    assert (await ready.json())["decode"]["available"] == 0


async def test_breaker_opens_after_failures_then_503(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [500] * 100
    client = await make_router([p], [d], breaker_failure_threshold=4, retry_max_attempts=2)
    statuses = [(await client.post("/generate", json={"text": "x"})).status for _ in range(3)]
    assert statuses[:2] == [500, 500]
    assert statuses[2] == 503  # 4 failures opened the decode's circuit
    body = await (await client.post("/generate", json={"text": "x"})).json()
    assert "open circuit" in body["error"]
    assert len(d.bodies) == 4
    workers = await (await client.get("/workers")).json()
    assert workers["decode"][0]["circuit"] == "open"
    assert workers["prefill"][0]["circuit"] == "closed"
    metrics = await (await client.get("/metrics")).text()
    assert 'kvatlas_router_breaker_state{instance="%s",role="decode"} 2.0' % \
        workers["decode"][0]["instance_id"] in metrics


async def test_models_health_liveness(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny")
    assert (await (await client.get("/v1/models")).json())["data"][0]["id"] == "tiny"
    assert (await client.get("/health")).status == 200
    assert (await client.get("/liveness")).status == 200
    ready = await client.get("/readiness")
    assert ready.status == 200
    detail = await ready.json()
    assert detail["prefill"]["available"] == 1 and detail["index"]["state"].startswith("off")
    resp = await client.post("/v1/completions", json={"prompt": "x", "model": "tiny"})
    assert resp.status == 200


async def test_loads_return_to_zero_after_concurrent_mixed_traffic(stubs: Any,
                                                                   make_router: Any) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode", 2)
    prefills[0].statuses = [500, 200, 500] * 4
    decodes[1].statuses = [503, 200] * 6
    for s in prefills + decodes:
        s.delay = 0.02
    client = await make_router(prefills, decodes)

    async def one(i: int) -> int:
        body: dict[str, Any] = {"text": f"req {i} " * 10, "stream": i % 3 == 0}
        resp = await client.post("/generate", json=body)
        await resp.read()
        return resp.status

    statuses = await asyncio.gather(*(one(i) for i in range(30)))
    assert statuses.count(200) == 30

    last: list[list[int]] = []

    async def idle() -> bool:
        workers = await (await client.get("/workers")).json()
        last[:] = [[w["load"] for role in ("prefill", "decode") for w in workers[role]]]
        return last[0] == [0, 0, 0, 0]

    # Streamed requests' prefill answers are read in the background after the client is done.
    await wait_until(idle, what="every worker's load is back to 0", detail=lambda: last)


async def test_metrics_on_a_separate_port_as_sglang_router_serves_them(
        stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], model="tiny", prometheus_port=0)
    port = client.app.metrics_port
    assert port is not None and port != client.app.port
    assert (await client.post("/generate", json={"text": "counted"})).status == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
            assert r.status == 200
        assert 'kvatlas_router_requests_total{route="/generate",status="200"} 1.0' in text
        async with s.head(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200 and await r.read() == b""
        # Only the metrics: the router's API stays on its own port.
        async with s.post(f"http://127.0.0.1:{port}/generate", json={"text": "x"}) as r:
            assert r.status == 404 and "only GET /metrics" in (await r.json())["error"]
    assert len(p.bodies) == 1


async def test_a_metrics_port_in_use_fails_the_start_and_frees_the_main_port(
        stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        app = create_app(router_config([p], [d], prometheus_port=busy.getsockname()[1]))
        with pytest.raises(OSError):
            await app.start("127.0.0.1", 0)
    assert app.port is not None
    with socket.socket() as again:
        again.bind(("127.0.0.1", app.port))  # released: nothing listens there any more


async def test_a_stopping_router_lets_requests_in_flight_finish(stubs: Any,
                                                                start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.delay = 0.5
    app = create_app(router_config([p], [d], shutdown_grace=5.0))
    port = await app.start("127.0.0.1", 0)
    async with aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(s.post(f"http://127.0.0.1:{port}/generate",
                                               json={"text": "in flight"}))
        while not d.bodies:
            await asyncio.sleep(0.01)
        await app.close()  # returns once the request in flight got its answer
        resp = await pending
        assert resp.status == 200 and (await resp.json())["worker"] == "decode0"
        # Nothing is accepted any more.
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.post(f"http://127.0.0.1:{port}/generate", json={"text": "late"})
