"""The real router in front of a real PD pair: a client's reused ``rid`` and clients that hang up
leave both pools at rest and the breakers closed."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from engine_helpers import assert_idle, wait_until
from pd_helpers import Pair, start_pair

from router.app import RouterApp, create_app
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)
IDS = [256, *b"a prompt the router sends to both halves of the pair at once"]


def _body(max_new: int, **extra: Any) -> dict[str, Any]:
    return {"input_ids": IDS, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                  "ignore_eos": True}, **extra}


@pytest.fixture
async def routed() -> AsyncIterator[tuple[Pair, RouterApp, str]]:
    pair = await start_pair()
    app = create_app(RouterConfig(prefill=[(pair.p_url, str(pair.bport))], decode=[pair.d_url],
                                  retry_initial_backoff=0.005))
    port = await app.start("127.0.0.1", 0)
    try:
        yield pair, app, f"http://127.0.0.1:{port}"
    finally:
        await app.close()
        await pair.decode.close()
        await pair.prefill.close()


def _at_rest(pair: Pair) -> bool:
    return not any(s.replica.running or s.replica.waiting or s.replica.held
                   for s in (pair.ps, pair.ds))


async def test_sixteen_requests_under_one_client_rid(routed: Any) -> None:
    pair, app, url = routed
    async with aiohttp.ClientSession() as s:
        async def one() -> tuple[int, Any]:
            async with s.post(url + "/generate", json=_body(4, rid="same")) as r:
                return r.status, await r.json()

        answers = await asyncio.gather(*(one() for _ in range(16)))
    assert [st for st, _ in answers] == [200] * 16, answers
    assert {doc["meta_info"]["id"] for _, doc in answers} == {"same"}
    assert all(len(doc["output_ids"]) == 4 for _, doc in answers)
    await wait_until(lambda: _at_rest(pair), "both pools at rest")
    assert_idle(pair.ps.replica)
    assert_idle(pair.ds.replica)
    assert all(w.breaker.state == "closed" for w in app.state.pools.all())


async def test_clients_hanging_up_mid_stream_leave_the_pair_at_rest(routed: Any) -> None:
    pair, app, url = routed
    async with aiohttp.ClientSession() as s:
        for i in range(12):  # more than the 10 failures that open a circuit
            r = await s.post(url + "/generate", json=_body(1500, stream=True, rid=f"stop{i}"))
            assert r.status == 200
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 30)
            assert json.loads(first[len(b"data: "):])["meta_info"]["id"] == f"stop{i}"
            r.close()  # the user pressed "stop"
            await wait_until(lambda: _at_rest(pair), "the engines to abort the request")
        assert_idle(pair.ps.replica)
        assert_idle(pair.ds.replica)
        assert all(w.breaker.state == "closed" for w in app.state.pools.all())
        async with s.post(url + "/generate", json=_body(3)) as r:
            assert r.status == 200 and len((await r.json())["output_ids"]) == 3


async def test_the_router_refuses_what_the_engines_refuse_in_their_words(routed: Any) -> None:
    """The router learns each worker's prompt limit from its /server_info and refuses a longer
    prompt itself (the pair sees nothing); a body not in UTF-8 gets the engines' very answer."""
    pair, app, url = routed
    await wait_until(lambda: all(w.limits.prompt for w in app.state.pools.all()), "limits learned")
    async with aiohttp.ClientSession() as s:
        async with s.get(pair.p_url + "/server_info") as r:
            limit = (await r.json())["max_prompt_tokens"]
        body = {"input_ids": [65] * (limit + 1), "sampling_params": {"max_new_tokens": 1}}
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert f"at most {limit} are taken (max_prompt_tokens of worker" in error, error
        assert await _admitted(s, pair.p_url) == 0  # refused before the pair saw it
        body["input_ids"] = body["input_ids"][:limit]  # at the limit: served
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
        assert await _admitted(s, pair.p_url) == 1
        raw = json.dumps(_body(1)).encode("utf-16")
        answers = []
        for target in (url, pair.p_url, pair.d_url):
            async with s.post(target + "/generate", data=raw,
                              headers={"content-type": "application/json"}) as r:
                answers.append((r.status, (await r.json())["error"]))
        assert answers == [(400, "body: is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)")] * 3


async def _admitted(s: aiohttp.ClientSession, url: str) -> float:
    """Requests the engine at ``url`` admitted (its /metrics)."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvatlas_engine_requests_total"))
