"""vLLM's PD contract (``--pd-protocol vllm-pull|vllm-push``) on one prefill and one decode in
this process (real ZMQ and HTTP): greedy output equals monolithic in both modes, many in flight,
with shared prefixes; bad params are 400s naming the field; a pull prefill whose decode never
comes gives its pages back after the lease; an SGLang pair refuses vLLM params and back."""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from engine_helpers import shared_prefix_prompts
from pd_helpers import Pair, monolithic, start_pair
from vllm_pd_client import post, prefill_body, pull, push
from waiting import wait_until

from engine.pd.vllm_params import base_request_id, room_of
from index.pd_protocol import PDProtocol

pytestmark = pytest.mark.timeout(120)


def body_of(ids: list[int], n: int, **more: Any) -> dict[str, Any]:
    return {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "min_tokens": None, **more}


def message(doc: Any) -> str:
    err = doc["error"]
    return err["message"] if isinstance(err, dict) else err


async def close(p: Pair) -> None:
    await p.decode.close()
    await p.prefill.close()


@pytest.fixture(params=["vllm-pull", "vllm-push"])
async def vpair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    proto = PDProtocol.parse(request.param)
    p = await start_pair(decode_over={"pd_protocol": proto},
                         prefill_over={"pd_protocol": proto, "kv_lease_s": 30.0})
    try:
        yield p
    finally:
        await close(p)


async def run_one(s: Any, p: Pair, body: dict[str, Any], chat: bool = False
                  ) -> tuple[tuple[int, Any], tuple[int, Any]]:
    if p.ps.cfg.pd_protocol.mode == "pull":
        return await pull(s, p.p_url, p.d_url, body, chat)
    return await push(s, p.p_url, p.d_url, body, engine_id=p.ps.cfg.instance_id,
                      host="127.0.0.1", port=p.bport, tp_size=1, chat=chat)


async def pages_back(p: Pair) -> None:
    await wait_until(lambda: not p.ps.replica.held and not p.ps.leases,
                     what="the prefill holds no page and no lease",
                     detail=lambda: (list(p.ps.replica.held), len(p.ps.leases)))
    await wait_until(lambda: p.ds.replica.pool.num_free == p.ds.replica.pool.num_pages,
                     what="every decode page is free")


def test_room_of_pairs_the_two_ids() -> None:
    assert base_request_id("cmpl-abc-0123abcd") == "cmpl-abc"
    assert base_request_id("cmpl-abc") == "cmpl-abc"
    assert room_of("cmpl-abc") == room_of(base_request_id("cmpl-abc-deadbeef"))
    assert room_of("cmpl-abc") != room_of("chatcmpl-abc")
    assert all(room_of(f"cmpl-{i}") >= 1 for i in range(200))


async def test_many_in_flight_equal_monolithic(vpair: Pair) -> None:
    prompts = shared_prefix_prompts(24, seed=26, n_bases=3, base_len=(30, 60))
    max_new = [2 + i % 5 for i in range(len(prompts))]
    want = monolithic(prompts, max_new)
    gate = asyncio.Semaphore(12)
    async with aiohttp.ClientSession() as s:
        async def one(ids: list[int], n: int) -> Any:
            async with gate:
                (ps, pdoc), (ds, ddoc) = await run_one(s, vpair, body_of(ids, n))
            assert ps == 200 and ds == 200, (pdoc, ddoc)
            kv = pdoc["kv_transfer_params"]
            assert kv["transfer_mode"] == vpair.ps.cfg.pd_protocol.mode
            assert kv["remote_engine_id"] == vpair.ps.cfg.instance_id
            assert "kv_transfer_params" not in ddoc
            return ddoc
        docs: list[Any] = await asyncio.gather(*(one(ids, n)
                                                 for ids, n in zip(prompts, max_new)))
    for doc, n in zip(docs, max_new):
        assert doc["usage"]["completion_tokens"] == n
    # token-level equality: the decode's text is the monolithic tokens' detokenization
    tok = vpair.ds.replica.tokenizer
    assert [d["choices"][0]["text"] for d in docs] == [tok.decode(w) for w in want]
    await pages_back(vpair)


async def test_chat_and_stream(vpair: Pair) -> None:
    chat = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "temperature": 0, "min_completion_tokens": None}
    async with aiohttp.ClientSession() as s:
        (ps, pdoc), (ds, ddoc) = await run_one(s, vpair, chat, chat=True)
        assert ps == 200 and ds == 200, (pdoc, ddoc)
        assert pdoc["id"].startswith("chatcmpl-")
        assert pdoc["kv_transfer_params"]["remote_request_id"] == pdoc["id"]
        assert ddoc["object"] == "chat.completion"
        (ps, _), (ds, raw) = await run_one(s, vpair, body_of([256, *b"streamed"], 5,
                                                              stream=True))
        assert ps == 200 and ds == 200
        assert raw.rstrip().endswith("data: [DONE]")
    await pages_back(vpair)


async def test_bad_params_are_400s_naming_the_field() -> None:
    proto = PDProtocol.parse("vllm-pull")
    p = await start_pair(decode_over={"pd_protocol": proto},
                         prefill_over={"pd_protocol": proto})
    try:
        async with aiohttp.ClientSession() as s:
            rid = uuid.uuid4().hex
            st, pdoc = await post(s, p.p_url + "/v1/completions",
                                  prefill_body(body_of([256, 1, 2, 3], 2)), rid)
            assert st == 200, pdoc
            good = pdoc["kv_transfer_params"]
            cases = {"remote_host": None, "remote_port": "x", "remote_request_id": "",
                     "remote_engine_id": None, "remote_block_ids": [],
                     "do_remote_prefill": False, "transfer_mode": "push"}
            for name, bad in cases.items():
                body = {**body_of([256, 1, 2, 3], 2), "kv_transfer_params": {**good,
                                                                             name: bad}}
                async with s.post(p.d_url + "/v1/completions", json=body) as r:
                    doc = await r.json()
                    assert r.status == 400 and f"kv_transfer_params.{name}" in message(doc), doc
            # a vLLM decode refuses SGLang's bootstrap fields, naming what it speaks
            sg = {"prompt": [256, 1, 2], "max_tokens": 2, "bootstrap_host": "127.0.0.1",
                  "bootstrap_port": p.bport, "bootstrap_room": 7}
            async with s.post(p.d_url + "/v1/completions", json=sg) as r:
                doc = await r.json()
                assert r.status == 400 and "vllm-pull" in message(doc), doc
            # the pulled KV was never fetched: the lease still holds it; one decode takes it
            async with s.post(p.d_url + "/v1/completions", json={
                    **body_of([256, 1, 2, 3], 2), "kv_transfer_params": good}) as r:
                assert r.status == 200, await r.text()
        await pages_back(p)
    finally:
        await close(p)


async def test_pull_lease_expires_and_releases_the_pages() -> None:
    proto = PDProtocol.parse("vllm")
    p = await start_pair(decode_over={"pd_protocol": proto},
                         prefill_over={"pd_protocol": proto, "kv_lease_s": 0.5})
    try:
        async with aiohttp.ClientSession() as s:
            rid = uuid.uuid4().hex
            async with s.post(p.p_url + "/v1/completions", headers={"X-Request-Id": rid},
                              json=prefill_body(body_of([256, *range(1, 44)], 4))) as r:
                doc = await r.json()
                assert r.status == 200, doc
            kv = doc["kv_transfer_params"]
            assert kv["remote_block_ids"][0] and kv["remote_request_id"].startswith(
                f"cmpl-{rid}-")
            assert p.ps.replica.held, "the pulled KV should be held for its decode"
            # the same X-Request-Id again while its KV is held: refused, naming the id
            async with s.post(p.p_url + "/v1/completions", headers={"X-Request-Id": rid},
                              json=prefill_body(body_of([256, 5, 6], 4))) as r:
                again = await r.json()
                assert r.status == 409 and f"cmpl-{rid}" in message(again), again
            await wait_until(lambda: p.ps.stats["expired"] == 1,
                             what="the lease expired", detail=lambda: p.ps.stats)
            await pages_back(p)
            # the decode that comes late is told the KV is gone, and holds nothing
            async with s.post(p.d_url + "/v1/completions", headers={"X-Request-Id": rid},
                              json={**body_of([256, *range(1, 44)], 4),
                                    "kv_transfer_params": kv}) as r:
                assert r.status in (502, 503), await r.text()
            await pages_back(p)
    finally:
        await close(p)


async def test_sglang_pair_refuses_vllm_params() -> None:
    p = await start_pair()
    try:
        async with aiohttp.ClientSession() as s:
            for url in (p.p_url, p.d_url):
                body = {**body_of([256, 1, 2], 2), "kv_transfer_params": {
                    "do_remote_decode": True}}
                async with s.post(url + "/v1/completions", json=body) as r:
                    doc = await r.json()
                    assert r.status == 400 and "--pd-protocol" in message(doc), doc
    finally:
        await close(p)
