"""The worker HTTP API under hostile or careless clients: hang-ups of non-streaming requests abort
them, a refused streaming request is a 4xx JSON answer rather than an empty 200, deep JSON and
huge bodies are 4xx, unsupported OpenAI fields are refused, and an odd temperature hurts no one."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from engine_helpers import wait_until
from error_shapes import error_message

from engine.http_common import STATE_KEY
from engine.serve_config import EngineServerConfig
from engine.server import create_app
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(90)
LONG_SP = {"max_new_tokens": 1900, "temperature": 0, "ignore_eos": True}


async def client_for(aiohttp_client: Any, **kw: Any) -> Any:
    return await aiohttp_client(create_app(EngineServerConfig(**kw)))


async def test_client_hangup_aborts_a_non_streaming_request(
        caplog: pytest.LogCaptureFixture) -> None:
    # aiohttp's default runner (web.run_app, AppRunner) does not cancel handlers on disconnect
    app = create_app(EngineServerConfig())
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        sched = app[STATE_KEY].engine.scheduler
        for i, (path, body) in enumerate([
                ("/generate", {"text": "hang up on me", "sampling_params": LONG_SP}),
                ("/v1/completions", {"prompt": "hang up on me", "max_tokens": 1900,
                                     "temperature": 0, "ignore_eos": True})]):
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(session.post(f"http://127.0.0.1:{port}{path}",
                                                        json=body))
                await wait_until(lambda: len(sched.running) == 1, f"{path} running")
                task.cancel()  # the client goes away: its connection is closed
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_until(lambda: not sched.running and sched.cache.pages_in_use == 0,
                           f"{path} aborted and its pages freed")
            assert sched.totals["aborted"] == i + 1
            assert sched.totals["generated_tokens"] < 1900 * (i + 1)
            assert runner.server is not None
            await wait_until(lambda: not runner.server.connections, f"{path}'s handler ended")
        # a hang-up is the client's business: no error (aiohttp's "Error handling request"
        # with a traceback) per hung-up request, which hostile clients would turn into a flood
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
    finally:
        await runner.cleanup()


async def test_duplicate_rid_on_a_stream_is_a_409_json(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    sched = c.server.app[STATE_KEY].engine.scheduler
    body = {"text": "first", "rid": "dup-1", "stream": True, "sampling_params": LONG_SP}
    first = await c.post("/generate", json=body)
    assert first.status == 200
    await first.content.readline()
    await wait_until(lambda: len(sched.running) == 1, "the first request running")
    dup = await c.post("/generate", json=body)
    assert dup.status == 409 and dup.headers["Content-Type"].startswith("application/json")
    assert "already in flight" in (await dup.json())["error"]
    r = await c.post("/abort_request", json={"rid": "dup-1"})
    assert await r.json() == {"rid": "dup-1", "aborted": True}
    first.close()
    await wait_until(lambda: sched.cache.pages_in_use == 0, "pages freed")


async def test_deeply_nested_json_is_a_400(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    for path in ("/generate", "/v1/completions"):
        r = await c.post(path, data=b"[" * 100_000 + b"]" * 100_000)
        assert r.status == 400, await r.text()
        assert "nested too deeply" in error_message(path, await r.json())


async def test_huge_bodies_are_refused_early(aiohttp_client: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    c = await client_for(aiohttp_client)
    # a 5 MB text under the body limit: refused from its length, not tokenized byte by byte
    # (the tokenizer refuses to run, so a refusal that came after tokenizing would be a 500)
    def never(text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("a text over the model's positions was tokenized")

    with monkeypatch.context() as m:
        m.setattr(c.server.app[STATE_KEY].tokenizer, "encode", never)
        r = await c.post("/generate", json={"text": "z" * 5_000_000})
        assert r.status == 400 and "the model takes at most" in (await r.json())["error"]
    # an over-long id list is refused before its elements are checked one by one
    ids = [1] * 2999 + [10**9]
    r = await c.post("/generate", json={"input_ids": ids})
    err = (await r.json())["error"]
    assert r.status == 400 and "prompt has 3000 tokens" in err, err
    r = await c.post("/v1/completions", json={"prompt": ids})
    assert r.status == 400 and "prompt has 3000 tokens" in error_message("/v1/completions",
                                                                         await r.json())
    # a body over the 8 MiB default: 413 with a JSON error
    for path in ("/generate", "/v1/chat/completions"):
        r = await c.post(path, data=json.dumps({"text": "z" * 9_000_000}).encode(),
                         headers={"Content-Type": "application/json"})
        assert r.status == 413 and r.headers["Content-Type"].startswith("application/json")
        assert "max-request-bytes" in error_message(path, await r.json())
    assert (await c.post("/generate", json={"text": "still fine", "sampling_params": {
        "max_new_tokens": 2}})).status == 200


async def test_body_limit_is_configurable(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client, max_request_bytes=1 << 20)
    r = await c.post("/generate", data=json.dumps({"text": "z" * 2_000_000}).encode(),
                     headers={"Content-Type": "application/json"})
    assert r.status == 413 and str(1 << 20) in (await r.json())["error"]
    with pytest.raises(ValueError, match="max_request_bytes"):
        EngineServerConfig(max_request_bytes=0)


async def test_too_many_or_too_long_stop_strings_are_400(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    for stop, needle in [(["s"] * 33, "at most 32 stop strings"),
                         (["s" * 257], "at most 256")]:
        r = await c.post("/generate", json={"text": "a", "sampling_params": {"stop": stop}})
        assert r.status == 400 and needle in (await r.json())["error"]
        r = await c.post("/v1/completions", json={"prompt": "a", "stop": stop})
        assert r.status == 400 and needle in error_message("/v1/completions", await r.json())
    r = await c.post("/generate", json={"text": "a", "sampling_params": {
        "stop": ["s" * 256] * 32, "max_new_tokens": 2}})
    assert r.status == 200


UNSUPPORTED: list[tuple[str, Any]] = [
    ("logprobs", True), ("logprobs", 3), ("top_logprobs", 2), ("echo", True), ("best_of", 2),
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("logit_bias", {"65": 10}),
]


async def test_unsupported_openai_fields_are_refused(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    comp = {"prompt": "hi", "max_tokens": 2}
    for key, value in UNSUPPORTED:
        for path, base in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
            r = await c.post(path, json={**base, key: value})
            assert r.status == 400, (path, key, value, r.status)
            err = error_message(path, await r.json())
            assert err.startswith(f"{key}:") and "not supported" in err, err
    # the default values mean "not used" and are accepted
    defaults = {"logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0,
                "frequency_penalty": 0.0, "logit_bias": {}}
    for path, base in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        r = await c.post(path, json={**base, **defaults})
        assert r.status == 200, await r.text()
    r = await c.post("/v1/chat/completions", json={**chat, "logprobs": False})
    assert r.status == 200


async def test_near_zero_temperature_beside_another_request(aiohttp_client: Any) -> None:
    c = await client_for(aiohttp_client)
    victim = {"text": "an innocent request", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    alone = await (await c.post("/generate", json=victim)).json()
    odd = {"text": "an odd one", "sampling_params": {
        "max_new_tokens": 16, "temperature": 5e-324, "ignore_eos": True}}
    a, b = await asyncio.gather(c.post("/generate", json=victim), c.post("/generate", json=odd))
    assert a.status == 200 and b.status == 200, (await a.text(), await b.text())
    assert (await a.json())["output_ids"] == alone["output_ids"]
    greedy_odd = {**odd, "sampling_params": {**odd["sampling_params"], "temperature": 0}}
    ref = await (await c.post("/generate", json=greedy_odd)).json()
    assert (await b.json())["output_ids"] == ref["output_ids"]


async def test_max_prompt_tokens_counts_the_kv_pool(aiohttp_client: Any) -> None:
    """A pool smaller than the model's positions bounds the prompt /server_info states: a
    longer one is a 503 here, which a router must refuse itself, not take for a failure."""
    c = await client_for(aiohttp_client, num_pages=8)  # 8 pages of 16 tokens: 128 < 2047
    for path in ("/server_info", "/model_info"):
        assert (await (await c.get(path)).json())["max_prompt_tokens"] == 128
    sp = {"max_new_tokens": 1, "temperature": 0}
    r = await c.post("/generate", json={"input_ids": [1] * 128, "sampling_params": sp})
    assert r.status == 200, await r.text()
    r = await c.post("/generate", json={"input_ids": [1] * 129, "sampling_params": sp})
    assert r.status == 503, await r.text()
