"""One prefill and one decode (one rank each, in this process, real ZMQ and HTTP): PD output
equals monolithic output, the prefill reuses its prefix cache, the decode streams and keeps
per-room evidence, and requests without bootstrap fields are refused."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from engine_helpers import shared_prefix_prompts
from pd_helpers import Pair, dual, monolithic, new_room, pair, pd_body  # noqa: F401 (fixture)
from waiting import wait_until_sync

pytestmark = pytest.mark.timeout(60)


async def test_pd_equals_monolithic_with_prefix_reuse(pair: Pair) -> None:
    prompts = shared_prefix_prompts(12, seed=5, n_bases=3, base_len=(30, 60))
    max_new = [3 + i % 5 for i in range(len(prompts))]
    want = monolithic(prompts, max_new)
    async with aiohttp.ClientSession() as s:
        got, cached = [], 0
        for ids, n in zip(prompts, max_new):
            (ps, pbody), (ds, dbody) = await dual(s, pair.p_url, pair.d_url,
                                                  pd_body(ids, n, pair.bport))
            assert ps == 200 and ds == 200, (pbody, dbody)
            assert pbody["output_ids"] == dbody["output_ids"][:1]
            cached += pbody["meta_info"]["cached_tokens"]
            assert dbody["meta_info"]["cached_tokens"] == pbody["meta_info"]["cached_tokens"]
            got.append(dbody["output_ids"])
    assert got == want
    assert cached > 0, "the prefill never reused its prefix cache"
    assert pair.ds.replica.pool.num_free == pair.ds.replica.pool.num_pages
    assert not pair.ps.replica.held


async def test_stream_and_room_evidence(pair: Pair) -> None:
    ids = [256, *b"streaming through the disaggregated pair"]
    [want] = monolithic([ids], [6])
    room = new_room()
    async with aiohttp.ClientSession() as s:
        (ps, _), (ds, raw) = await dual(s, pair.p_url, pair.d_url,
                                        pd_body(ids, 6, pair.bport, room, stream=True))
        assert ps == 200 and ds == 200
        events = [b[len("data: "):] for b in raw.split("\n\n") if b]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 7))
        assert chunks[-1]["output_ids"] == want
        async with s.get(f"{pair.d_url}/debug/rooms/{room}") as r:
            doc = await r.json()
        assert r.status == 200 and doc["state"] == "done" and doc["stage"] == "consumed"
        assert [st["stage"] for st in doc["stages"]] == [
            "registered", "resolved_topology", "resolved_ranks", "connected", "verified",
            "consumed"]
        assert doc["ranks"]["tp0_reads"] == [pair.ps.sender.endpoint]
        async with s.get(f"{pair.d_url}/debug/rooms/{room + 1}") as r:
            assert r.status == 404


async def test_requests_without_bootstrap_fields_are_refused(pair: Pair) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as s:
        for url in (pair.p_url, pair.d_url):
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 400
                assert "send PD requests through the router" in (await r.json())["error"]
            bad = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1,
                   "bootstrap_room": "x"}
            async with s.post(url + "/generate", json=bad) as r:
                assert r.status == 400 and "bootstrap_room" in (await r.json())["error"]


async def test_seeded_sampling_continues_the_prefills_stream(pair: Pair) -> None:
    """The decode's generator skips the draw the prefill made for the first token, so seeded
    sampling gives the monolithic engine's tokens too."""
    from engine.config import get_model_config
    from engine.runner import build_scheduler, run_to_completion
    from engine.sampling import SamplingParams
    from engine.scheduler import Request

    ids = [256, *b"seeded sampling across the pair"]
    sp = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 4242,
          "ignore_eos": True}
    sched = build_scheduler(get_model_config("tiny"), num_pages=64)
    ref = run_to_completion(sched, [Request("r", ids, SamplingParams(
        max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=4242, ignore_eos=True))])
    async with aiohttp.ClientSession() as s:
        body = {**pd_body(ids, 12, pair.bport), "sampling_params": sp}
        (ps, _), (ds, dbody) = await dual(s, pair.p_url, pair.d_url, body)
    assert (ps, ds) == (200, 200)
    assert dbody["output_ids"] == ref["r"].output_ids


async def post_pair(s: aiohttp.ClientSession, pair: Pair, path: str, body: dict[str, Any]
                    ) -> tuple[int, int, str]:
    """(prefill status, decode status, decode body text) of one request sent to both."""
    async def post(url: str) -> tuple[int, str]:
        async with s.post(url + path, json=body) as r:
            return r.status, await r.text()
    (ps, _), (ds, text) = await asyncio.gather(post(pair.p_url), post(pair.d_url))
    return ps, ds, text


async def test_openai_endpoints_answer_as_generate_does(pair: Pair) -> None:
    """SGLang's PD servers take OpenAI requests too (the router forwards them as they are)."""
    boot = lambda: {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.bport,  # noqa: E731
                    "bootstrap_room": new_room()}
    messages = [{"role": "user", "content": "disaggregated serving, in short?"}]
    greedy = {"max_tokens": 6, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        # The reference: the same prompts through /generate (checked against monolithic above).
        chat_ids = [256, *b"<|user|>\ndisaggregated serving, in short?\n<|assistant|>\n"]
        ps, ds, ref_chat = await post_pair(s, pair, "/generate", {
            **pd_body(chat_ids, 6, pair.bport)})
        ps2, ds2, ref_text = await post_pair(s, pair, "/generate", {
            **pd_body([256, *b"a completion prompt"], 6, pair.bport)})
        assert (ps, ds, ps2, ds2) == (200, 200, 200, 200)

        ps, ds, text = await post_pair(s, pair, "/v1/chat/completions",
                                       {"messages": messages, **greedy, **boot()})
        assert (ps, ds) == (200, 200), text
        doc = json.loads(text)
        assert doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
        assert doc["choices"][0]["message"]["content"] == json.loads(ref_chat)["text"]
        assert doc["usage"]["completion_tokens"] == 6
        assert doc["usage"]["prompt_tokens"] == len(chat_ids)

        ps, ds, text = await post_pair(s, pair, "/v1/completions",
                                       {"prompt": "a completion prompt", **greedy, **boot(),
                                        "stream": True, "stream_options": {"include_usage": True}})
        assert (ps, ds) == (200, 200), text
        events = [e[len("data: "):] for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert streamed == json.loads(ref_text)["text"]
        assert chunks[-1]["usage"]["completion_tokens"] == 6
        # The prefill's cache served the repeated prompt, and the decode reports it.
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

        # Bad input is a 400 on both halves, before anything starts.
        ps, ds, text = await post_pair(s, pair, "/v1/completions",
                                       {"prompt": "x", "n": 2, **boot()})
        assert (ps, ds) == (400, 400) and "n: only n = 1" in text
        ps, ds, text = await post_pair(s, pair, "/v1/chat/completions", {"messages": messages})
        assert (ps, ds) == (400, 400) and "send PD requests through the router" in text
    assert pair.ds.replica.pool.num_free == pair.ds.replica.pool.num_pages
    assert not pair.ps.replica.held


def batch_body(prompts: list[list[int]], max_new: int, bport: int) -> dict[str, Any]:
    """What the router sends for a batch: one room per prompt."""
    return {**pd_body(prompts[0], max_new, bport), "input_ids": prompts,
            "bootstrap_room": [new_room() for _ in prompts]}


async def test_a_batch_is_served_item_by_item_with_a_room_each(pair: Pair) -> None:
    prompts = shared_prefix_prompts(4, seed=9, n_bases=1, base_len=(40, 40))
    want = monolithic(prompts, [5] * 4)
    body = batch_body(prompts, 5, pair.bport)
    body["bootstrap_port"] = [pair.bport] * 4  # lists or one value: both as SGLang sends
    async with aiohttp.ClientSession() as s:
        (ps, pbody), (ds, dbody) = await dual(s, pair.p_url, pair.d_url, body)
        assert (ps, ds) == (200, 200), (pbody, dbody)
        assert [d["output_ids"] for d in dbody] == want
        assert [p["meta_info"]["bootstrap_room"] for p in pbody] == body["bootstrap_room"]
        assert [d["output_ids"][:1] for d in dbody] == [p["output_ids"] for p in pbody]
        for room in body["bootstrap_room"]:
            async with s.get(f"{pair.d_url}/debug/rooms/{room}") as r:
                assert (await r.json())["state"] == "done"
    assert pair.ds.replica.pool.num_free == pair.ds.replica.pool.num_pages
    assert not pair.ps.replica.held


@pytest.mark.parametrize(("change", "needle"), [
    ({"bootstrap_room": 5}, "needs a list of 3 rooms"),
    ({"bootstrap_room": [1, 2]}, "needs 3 values, got 2"),
    ({"bootstrap_room": [7, 7, 8]}, "its own room"),
    ({"bootstrap_host": ["127.0.0.1"]}, "bootstrap_host: a batch of 3"),
    ({"stream": True}, "single prompt"),
    ({"input_ids": [[1, 2], [3, -4], [5]]}, "batch item 1: input_ids"),
    ({"bootstrap_room": [1, "x", 3]}, "batch item 1: bootstrap_room"),
    ({"input_ids": []}, "input_ids"),
    ({"rid": "same-for-all"}, "rid: for a batch, must be a list of distinct ids"),
    ({"input_ids": [[256, 1], [256, 2], [256] * 5000]}, "batch item 2: input_ids"),
])
async def test_a_malformed_batch_is_refused_before_any_item_starts(
        pair: Pair, change: dict[str, Any], needle: str) -> None:
    body = {**batch_body([[256, 1, 2], [256, 3], [256, 4]], 2, pair.bport), **change}
    async with aiohttp.ClientSession() as s:
        for url in (pair.p_url, pair.d_url):
            async with s.post(url + "/generate", json=body) as r:
                doc = await r.json()
                assert r.status == 400 and needle in doc["error"], doc
    assert not pair.ds.rooms.active and not pair.ds.rooms.finished and not pair.ps.replica.held


async def test_a_batch_with_a_used_room_opens_none(pair: Pair) -> None:
    ids = [256, *b"first"]
    async with aiohttp.ClientSession() as s:
        body = pd_body(ids, 2, pair.bport)
        (ps, _), (ds, _) = await dual(s, pair.p_url, pair.d_url, body)
        assert (ps, ds) == (200, 200)
        again = batch_body([ids, ids], 2, pair.bport)
        again["bootstrap_room"][1] = body["bootstrap_room"]
        async with s.post(pair.d_url + "/generate", json=again) as r:
            assert r.status == 400 and "already used" in (await r.json())["error"]
    assert not pair.ds.rooms.active and set(pair.ds.rooms.finished) == {body["bootstrap_room"]}


def test_room_log_retention_is_bounded_by_count_and_age() -> None:
    from engine.pd.rooms import RoomLog

    log = RoomLog(keep=2, ttl_s=0.2)
    recs = [log.open(r, f"rid{r}", "h:1") for r in (1, 2, 3)]
    assert log.get(2) is recs[1] and log.counts()["in_flight"] == 3
    for rec in recs:
        log.close(rec, error={"stage": "verified"} if rec.room == 3 else None)
    assert log.get(1) is None and log.get(2) is not None  # only the last two finished kept
    assert log.counts() == {"in_flight": 0, "done": 1, "failed": 1}
    # and only for ttl_s
    wait_until_sync(lambda: log.get(3) is None and log.get(2) is None,
                    what="finished rooms older than ttl_s leave the log", timeout=10.0)
