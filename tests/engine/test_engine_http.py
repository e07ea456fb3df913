"""The worker's HTTP API with a real aiohttp client: SGLang and OpenAI shapes, streaming, stop
conditions, info endpoints, metrics, KV events, aborts, capacity and every kind of bad input."""
from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
import zmq
import zmq.asyncio
from error_shapes import error_message
from memory_index import MemoryBlockIndex

from engine.http_common import STATE_KEY
from engine.serve_config import EngineServerConfig
from engine.server import create_app
from index.events.codec import END_SEQ, decode_payload
from index.events.ingest import InstanceIngestor
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(60)
PROMPT = "The quick brown fox jumps over the lazy dog, again and again."


async def client_for(aiohttp_client: Any, **kw: Any) -> Any:
    return await aiohttp_client(create_app(EngineServerConfig(**kw)))


async def sse_events(resp: Any) -> list[Any]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [block[len("data: "):] for block in raw.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def metric(client: Any, name: str) -> float:
    text = await (await client.get("/metrics")).text()
    for line in text.splitlines():
        if line.startswith(f"kvatlas_engine_{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


async def test_generate_shapes_streaming_and_cache_hits(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    sp = {"max_new_tokens": 8, "temperature": 0}
    r = await c.post("/generate", json={"text": PROMPT, "sampling_params": sp})
    assert r.status == 200
    body = await r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == 8 and isinstance(body["text"], str)
    assert meta["prompt_tokens"] == len(PROMPT) + 1 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["cached_tokens"] == 0 and isinstance(meta["id"], str)
    # the same prompt again reuses its full blocks and gives the same tokens
    again = await (await c.post("/generate", json={"text": PROMPT, "sampling_params": sp})).json()
    assert again["output_ids"] == body["output_ids"]
    assert again["meta_info"]["cached_tokens"] == (len(PROMPT) + 1) // 16 * 16
    # input_ids give the same as the text they encode
    ids = [256, *PROMPT.encode()]
    by_ids = await (await c.post("/generate", json={"input_ids": ids, "sampling_params": sp})).json()
    assert by_ids["output_ids"] == body["output_ids"]
    # streaming: cumulative chunks ending with the non-streamed result, then [DONE]
    events = await sse_events(await c.post("/generate", json={
        "text": PROMPT, "sampling_params": sp, "stream": True}))
    assert [len(e["output_ids"]) for e in events] == list(range(1, 9))
    assert events[-1]["output_ids"] == body["output_ids"] and events[-1]["text"] == body["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    # a batch of prompts answers a list in order
    batch = await (await c.post("/generate", json={"text": [PROMPT, "other"],
                                                   "sampling_params": sp})).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == body["output_ids"]


async def test_stop_token_and_stop_string(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    ref = await (await c.post("/generate", json={"text": PROMPT, "sampling_params": sp})).json()
    ids, text = ref["output_ids"], ref["text"]
    stop_id = ids[3]
    r = await (await c.post("/generate", json={"text": PROMPT, "sampling_params": {
        **sp, "stop_token_ids": [stop_id]}})).json()
    assert r["output_ids"] == ids[:ids.index(stop_id) + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    stop = text[5:7]
    events = await sse_events(await c.post("/generate", json={
        "text": PROMPT, "stream": True, "sampling_params": {**sp, "stop": [stop, "\x00never"]}}))
    assert events[-1]["text"] == text[:text.find(stop)]
    assert all(stop not in e["text"] for e in events)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_openai_completions_and_chat(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client, served_model_name="kv-tiny")
    req = {"model": "kv-tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = await (await c.post("/v1/completions", json=req)).json()
    assert r["object"] == "text_completion" and r["model"] == "kv-tiny"
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 6 and r["usage"]["total_tokens"] == 6 + len(PROMPT) + 1
    streamed = {**req, "stream": True, "stream_options": {"include_usage": True}}
    chunks = await sse_events(await c.post("/v1/completions", json=streamed))
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == r["choices"][0]["text"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]
    chat = {"model": "kv-tiny", "messages": msgs, "max_tokens": 5, "temperature": 0}
    r = await (await c.post("/v1/chat/completions", json=chat)).json()
    assert r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    prompt_len = len(f"<|system|>\nbe brief\n<|user|>\n{PROMPT}\n<|assistant|>\n".encode()) + 1
    assert r["usage"]["prompt_tokens"] == prompt_len
    chunks = await sse_events(await c.post("/v1/chat/completions", json={**chat, "stream": True}))
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == msg["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # seeded sampling is reproducible
    sampled = {**chat, "temperature": 0.8, "top_p": 0.9, "seed": 42, "max_tokens": 12}
    a = await (await c.post("/v1/chat/completions", json=sampled)).json()
    b = await (await c.post("/v1/chat/completions", json=sampled)).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]

    models = await (await c.get("/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "kv-tiny"


async def test_info_health_metrics_flush_and_kv_events(aiohttp_client: Any) -> None:
    pub_port, replay_port = free_port(), free_port()
    c = await client_for(aiohttp_client, kv_events=f"tcp://127.0.0.1:{pub_port}",
                         kv_events_replay=f"tcp://127.0.0.1:{replay_port}")
    for path in ("/health", "/health_generate"):
        assert (await c.get(path)).status == 200
    for path in ("/server_info", "/get_server_info"):
        info = await (await c.get(path)).json()
        assert info["page_size"] == 16 and info["dp_size"] == 1 and info["tp_size"] == 1
        assert os.path.isfile(os.path.join(info["model_path"], "config.json"))
    for path in ("/model_info", "/get_model_info"):
        info = await (await c.get(path)).json()
        assert info["is_generation"] is True and os.path.isdir(info["model_path"])
    sp = {"max_new_tokens": 4, "temperature": 0}
    for _ in range(2):
        r = await c.post("/generate", json={"text": PROMPT * 2, "sampling_params": sp})
        assert r.status == 200
    assert await metric(c, "cached_tokens_total") == (len(PROMPT) * 2 + 1) // 16 * 16
    assert await metric(c, "generation_tokens_total") == 8 + 1  # plus /health_generate's token
    assert await metric(c, "kv_pages_used") == 0 and await metric(c, "queue_length") == 0
    published = await metric(c, "kv_events_published_total")
    assert published >= 1

    # the published events, fetched through the replay ROUTER, rebuild the cache's blocks
    cache = c.server.app[STATE_KEY].engine.scheduler.cache
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    index = MemoryBlockIndex()
    ingest = InstanceIngestor(index, "w0")

    async def replay(start: int) -> None:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while (frames := await asyncio.wait_for(dealer.recv_multipart(), 10))[2] != END_SEQ:
            await ingest.on_batch(int.from_bytes(frames[2], "big"), decode_payload(frames[3]))

    try:
        await replay(0)
        assert index.blocks("w0") == cache.blocks() and cache.blocks()
        flushed = await (await c.post("/flush_cache")).json()
        assert flushed == {"flushed": True, "blocks": len(index.blocks("w0"))}
        await replay(ingest.stats.last_seq + 1)
        assert index.blocks("w0") == set() == cache.blocks()
    finally:
        dealer.close(0)
        ctx.term()


async def test_capacity_queueing_503_and_abort(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client, num_pages=8, max_batch_tokens=32)
    prompt = "x" * 40
    # 41 + 60 - 1 = 100 tokens -> 7 pages: fits alone, so a second one waits in the queue
    sp = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    a, b = await asyncio.gather(*(c.post("/generate", json={"text": prompt, "sampling_params": sp})
                                  for _ in range(2)))
    ra, rb = await a.json(), await b.json()
    assert a.status == b.status == 200 and ra["output_ids"] == rb["output_ids"]
    r = await c.post("/generate", json={"text": prompt, "sampling_params": {"max_new_tokens": 200}})
    assert r.status == 503 and "KV pages" in (await r.json())["error"]
    # a client that goes away mid-stream aborts its request and its pages come back
    resp = await c.post("/generate", json={"text": "abort me", "stream": True, "sampling_params": {
        "max_new_tokens": 100, "temperature": 0, "ignore_eos": True}})
    await resp.content.readline()
    resp.close()
    for _ in range(200):
        if await metric(c, "aborted_requests_total") == 1:
            break
        await asyncio.sleep(0.02)
    assert await metric(c, "aborted_requests_total") == 1
    assert await metric(c, "kv_pages_used") == 0 and await metric(c, "running_requests") == 0
    # the engine still serves
    assert (await c.post("/generate", json={"text": "ok", "sampling_params": sp})).status == 200


LONG = "y" * 2100
BAD: list[tuple[str, Any, str]] = [
    ("/generate", {"text": ""}, "text: must not be empty"),
    ("/generate", {"input_ids": []}, "input_ids: must not be empty"),
    ("/generate", {}, "exactly one of text or input_ids"),
    ("/generate", {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ("/generate", {"text": LONG}, "the model takes at most"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens"),
    ("/generate", {"text": "a" * 2000, "sampling_params": {"max_new_tokens": 100}}, "ask for at most"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -0.5}}, "temperature"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"text": "\ud800abc"}, "not valid UTF-8"),
    ("/generate", {"input_ids": [1, 259]}, "outside the vocab"),
    ("/generate", {"input_ids": [1, -1]}, "outside the vocab"),
    ("/generate", {"input_ids": [1, "a"]}, "must be an integer"),
    ("/generate", {"text": 5}, "must be a string"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "8"}}, "must be an integer"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, "must be a number"),
    ("/generate", {"text": "a", "sampling_params": {"stop": 3}}, "stop"),
    ("/generate", {"text": "a", "sampling_params": {"seed": -1}}, "seed"),
    ("/generate", {"text": "a", "sampling_params": []}, "sampling_params: must be an object"),
    ("/generate", {"text": "a", "stream": "yes"}, "stream: must be a boolean"),
    ("/generate", {"text": ["a", "b"], "stream": True}, "single prompt"),
    ("/generate", {"text": ["a", "b"], "rid": "same"}, "one per prompt"),
    ("/generate", {"text": ["a", "b"], "rid": ["x"]}, "distinct"),
    ("/generate", {"text": "a", "rid": 3}, "rid: must be a non-empty string"),
    ("/generate", [1, 2], "must be a JSON object"),
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", b'{"text": "\xff\xfe"}', "body: is not UTF-8; send JSON encoded as UTF-8 (RFC 8259)"),
    ("/v1/completions", {"prompt": ""}, "prompt: must not be empty"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "n = 1"),
    ("/v1/completions", {"prompt": [1, 999]}, "outside the vocab"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "non-empty"),
    ("/v1/chat/completions", {"messages": "hi"}, "must be a list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "stream": True, "stream_options": 1}, "stream_options"),
]


async def test_bad_inputs_are_400_with_a_message(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    for path, body, needle in BAD:
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        r = await c.post(path, **kw)
        assert r.status == 400, (path, body, r.status, await r.text())
        err = error_message(path, await r.json())
        assert needle in err, (path, body, err)
    assert (await c.get("/nope")).status == 404
    sp = {"max_new_tokens": 2, "temperature": 0}
    r = await c.post("/generate", json={"text": "still alive", "sampling_params": sp})
    assert r.status == 200


async def test_abort_request_by_rid_and_duplicate_rid(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    body = {"text": "long", "rid": "long-1", "sampling_params": {
        "max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}}
    task = asyncio.create_task(c.post("/generate", json=body))
    for _ in range(500):
        if await metric(c, "running_requests") == 1:
            break
        await asyncio.sleep(0.01)
    dup = await c.post("/generate", json=body)
    assert dup.status == 409 and "already in flight" in (await dup.json())["error"]
    r = await c.post("/abort_request", json={"rid": "long-1"})
    assert await r.json() == {"rid": "long-1", "aborted": True}
    resp = await task
    meta = (await resp.json())["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1900
    assert await metric(c, "kv_pages_used") == 0
    r = await c.post("/abort_request", json={"rid": "long-1"})
    assert await r.json() == {"rid": "long-1", "aborted": False}
    assert (await c.post("/abort_request", json={"rid": 5})).status == 400
