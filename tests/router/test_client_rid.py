"""A client's ``rid`` is the client's: engines key work by ids the router makes unique, and the
client gets its own back (x-request-id, ``meta_info.id``)."""
from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from waiting import wait_until

from router.client_ids import RidEcho, client_rid
from router.errors import BadRequest


async def test_sixteen_concurrent_requests_with_one_rid_are_all_served(
        stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.hold, d.hold = asyncio.Event(), asyncio.Event()  # all 16 are in flight at once
    client = await make_router([p], [d])

    async def one(i: int) -> tuple[int, str, Any]:
        resp = await client.post("/generate", json={"text": f"q{i}", "rid": "same"})
        return resp.status, resp.headers["x-request-id"], await resp.json()

    pending = asyncio.gather(*(one(i) for i in range(16)))
    await wait_until(lambda: len(p.bodies) >= 16 and len(d.bodies) >= 16, timeout=10.0,
                     what="both workers got all 16 requests")
    p.hold.set()
    d.hold.set()
    answers = await asyncio.wait_for(pending, 10)
    assert [a[0] for a in answers] == [200] * 16, answers
    assert {a[1] for a in answers} == {"same"}
    assert {a[2]["meta_info"]["id"] for a in answers} == {"same"}
    for stub in (p, d):
        rids = [b["rid"] for b in stub.bodies]
        assert len(set(rids)) == 16 and "same" not in rids
    # One id per request, the same on both halves.
    assert {b["rid"] for b in p.bodies} == {b["rid"] for b in d.bodies}
    assert p.cancelled == d.cancelled == 0


async def test_a_streamed_answer_echoes_the_clients_rid(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "x", "stream": True, "rid": "mine \u00e9"})
    assert resp.status == 200
    events = [e for e in (await resp.read()).split(b"\n\n") if e and e != b"data: [DONE]"]
    assert len(events) == 3
    assert {json.loads(e[len(b"data: "):])["meta_info"]["id"] for e in events} == {"mine \u00e9"}
    assert d.bodies[0]["rid"] != "mine \u00e9" and d.bodies[0]["rid"] == p.bodies[0]["rid"]
    # Not printable ASCII: not fit for a header, so the router's own request id names it.
    assert resp.headers["x-request-id"] != "mine \u00e9"


async def test_a_batch_gets_one_unique_rid_per_item(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": ["a", "b", "c"], "rid": ["r", "r", "s"]})
    assert resp.status == 200
    assert [item["meta_info"]["id"] for item in await resp.json()] == ["r", "r", "s"]
    sent = d.bodies[0]["rid"]
    assert len(set(sent)) == 3 and not {"r", "s"} & set(sent) and p.bodies[0]["rid"] == sent
    resp = await client.post("/generate", json={"text": ["a", "b"], "rid": "one"})
    assert resp.status == 400 and "rid" in (await resp.json())["error"]
    assert len(d.bodies) == 1


async def test_each_attempt_gets_its_own_engine_rid(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.statuses = [503]
    client = await make_router([p], [d])
    resp = await client.post("/generate", json={"text": "again", "rid": "retried"},
                             headers={"x-request-id": "trace-1"})
    assert resp.status == 200
    assert (await resp.json())["meta_info"]["id"] == "retried"
    assert resp.headers["x-request-id"] == "trace-1"  # the header the client sent wins there
    assert len({b["rid"] for b in d.bodies}) == 2


async def test_without_a_rid_the_body_is_not_touched(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    assert (await client.post("/generate", json={"text": "x"})).status == 200
    assert "rid" not in d.bodies[0] and "rid" not in p.bodies[0]
    resp = await client.post("/generate", json={"text": "x", "rid": 7})
    assert resp.status == 400 and len(d.bodies) == 1
    resp = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "rid": "chat-1"})
    assert resp.status == 200 and resp.headers["x-request-id"] == "chat-1"
    assert d.bodies[1]["rid"] not in (None, "chat-1")


def test_a_stream_split_anywhere_echoes_the_same_bytes() -> None:
    """Upstream chunks may cut an id (or a line) anywhere; what the client gets is the whole
    answer rewritten, and no complete line is ever held back."""
    engine, client = "00ff00ff00ff00ff0000000000000001", 'a "quoted" \u2603'
    events = b"".join(b'data: {"text": "t%d", "meta_info": {"id": "%s"}}\n\n'
                      % (i, engine.encode()) for i in range(5))
    want = events.replace(b'"%s"' % engine.encode(), json.dumps(client).encode())
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(events)), rng.randint(1, 12)))
        echo = RidEcho(engine, client)
        out = b""
        for a, b in zip([0, *cuts], [*cuts, len(events)]):
            out += echo.chunk(events[a:b])
            # Every complete line received so far went out, rewritten; nothing more did.
            whole_lines = events[:events.rfind(b"\n", 0, b) + 1]
            assert out == whole_lines.replace(b'"%s"' % engine.encode(),
                                              json.dumps(client).encode())
        out += echo.rest()
        assert out == want


def test_client_rid_shapes() -> None:
    assert client_rid({"text": "x"}, None) is None
    assert client_rid({"rid": "a"}, None) == "a"
    assert client_rid({"rid": ["a", "a"]}, 2) == ["a", "a"]
    for body, batch in (({"rid": ""}, None), ({"rid": ["a"]}, None), ({"rid": "a"}, 2),
                        ({"rid": ["a"]}, 2), ({"rid": ["a", 1]}, 2), ({"rid": 5}, None)):
        with pytest.raises(BadRequest, match="^rid: "):
            client_rid(body, batch)


async def test_a_rid_costs_the_forwarded_body_no_growth(stubs: Any, make_router: Any) -> None:
    """With a client rid the body is written again (its rid replaced): in UTF-8, as it came,
    not with every non-ASCII character escaped (twice the bytes of CJK text), which would push
    a body the router took past the engines' own body limit. Bodies orjson does not parse (an
    int over 64 bits, a lone surrogate escape, 1e400) still go through, unchanged in meaning."""
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    text = "\u6f22\u5b57" * 20000  # 120 kB of UTF-8
    sent = json.dumps({"text": text, "rid": "wide"}, ensure_ascii=False).encode()
    resp = await client.post("/generate", data=sent,
                             headers={"content-type": "application/json"})
    assert resp.status == 200 and (await resp.json())["meta_info"]["id"] == "wide"
    for stub in (p, d):
        assert stub.bodies[0]["text"] == text
        assert int(stub.headers[0]["Content-Length"]) < len(sent) + 200
    odd = (b'{"text": "x", "rid": "odd", "big": 123456789012345678901234567890, '
           b'"sampling_params": {"stop": "\\ud800"}}')
    resp = await client.post("/generate", data=odd,
                             headers={"content-type": "application/json"})
    assert resp.status == 200 and (await resp.json())["meta_info"]["id"] == "odd"
    assert d.bodies[1]["big"] == 123456789012345678901234567890
    assert d.bodies[1]["sampling_params"]["stop"] == "\ud800"
    # 1e400 reaches the worker as its own parser reads it (inf), not as orjson writes an
    # infinity: null, which would pass for "unset".
    resp = await client.post("/generate", data=b'{"text": "x", "rid": "inf", "top_k": 1e400}',
                             headers={"content-type": "application/json"})
    assert resp.status == 200 and d.bodies[2]["top_k"] == float("inf")
