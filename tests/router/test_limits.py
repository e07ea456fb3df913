"""Prompt and body limits: an over-long prompt is a 400 naming the limit, refused at the router
before a worker sees it (the limit from --max-prompt-tokens, a worker's /server_info or its
etcd record), and a huge body never stalls the router's event loop."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
from error_shapes import error_message
from etcd_instances import wait_for

import router.requests as router_requests
from router.config import RouterConfig
from router.policy import MAX_ROUTED_BLOCKS, RouteContext, prompt_hashes
from router.prompt_hashes import PromptHasher
from router.requests import OFF_LOOP_BYTES

CONTEXT = 2048
"""The reference engine's context length: prompts of at most 2047 tokens."""


async def limits_known(client: Any, tokens: int) -> None:
    async def known() -> bool:
        workers = await (await client.get("/workers")).json()
        return all(w.get("max_prompt_tokens") == tokens
                   for role in ("prefill", "decode") for w in workers[role])

    await wait_for(known)


def over(limit: int) -> list[tuple[str, dict[str, Any], str]]:
    """(path, body, field) of prompts one token over ``limit`` (text gets BOS first)."""
    return [("/generate", {"text": "a" * limit}, "text"),
            ("/generate", {"text": "\u00e9" * (limit // 2)}, "text"),  # 2 bytes a character
            ("/generate", {"input_ids": [1] * (limit + 1)}, "input_ids"),
            ("/generate", {"text": ["ok", "a" * limit]}, "text[1]"),
            ("/v1/completions", {"prompt": "a" * limit}, "prompt"),
            ("/v1/completions", {"prompt": [[1] * (limit + 1)]}, "prompt[0]"),
            ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "a" * limit}]}, "messages")]


async def test_max_prompt_tokens_flag(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], max_prompt_tokens=100)
    for path, body, field in over(100):
        resp = await client.post(path, json=body)
        assert resp.status == 400, (path, body)
        error = error_message(path, await resp.json())
        assert error.startswith(f"{field}: prompt has ") and "at most 100" in error, error
        assert "--max-prompt-tokens" in error, error
    assert not p.bodies and not d.bodies
    # At the limit: routed.
    assert (await client.post("/generate", json={"text": "a" * 99})).status == 200
    assert (await client.post("/generate", json={"input_ids": [1] * 100})).status == 200
    assert len(d.bodies) == 2


async def test_limit_learned_from_server_info(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.server_info = {"context_length": 64}
    d.server_info = {"context_length": 32}  # the smaller one counts: both see the prompt
    client = await make_router([p], [d])
    async def learned() -> bool:
        workers = await (await client.get("/workers")).json()
        return [w["max_prompt_tokens"] for w in workers["prefill"] + workers["decode"]] \
            == [63, 31]
    await wait_for(learned)
    resp = await client.post("/generate", json={"text": "a" * 31})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "prompt has at least 32 tokens; at most 31" in error, error
    assert "context_length 32 of worker" in error, error
    assert not p.bodies and not d.bodies
    assert (await client.post("/generate", json={"text": "a" * 30})).status == 200
    # A body larger than a worker takes: 413 at the router.
    d.server_info["max_body_bytes"] = 2000
    client = await make_router([p], [d])
    await wait_for(learned)
    resp = await client.post("/generate", json={"text": "a", "x": "b" * 2000})
    assert resp.status == 413
    error = (await resp.json())["error"]
    assert "at most 2000 are taken (max_body_bytes of worker" in error, error
    assert (await client.post("/generate", json={"text": "a", "x": "b" * 1900})).status == 200
    # A flag below what the workers take wins.
    client = await make_router([p], [d], max_prompt_tokens=10)
    await wait_for(learned)
    resp = await client.post("/generate", json={"input_ids": [1] * 11})
    assert resp.status == 400 and "at most 10" in (await resp.json())["error"]


async def test_a_server_info_that_fails_is_asked_again(stubs: Any, make_router: Any) -> None:
    """A 5xx is no answer (a worker still starting, a proxy in front of it): the health checks
    ask again, and learn the limit once it answers. A 404 is an answer: no limit stated."""
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.server_info = d.server_info = {"context_length": 32}
    p.server_info_statuses = [503, 500]
    client = await make_router([p], [d], health_interval=0.02)
    await limits_known(client, 31)
    assert not p.server_info_statuses
    assert (await client.post("/generate", json={"text": "a" * 31})).status == 400


async def test_limit_learned_from_the_etcd_record(start_router: Any, etcd_settings: Any,
                                                  key_prefix: str, stubs: Any,
                                                  register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    await register("pre", {"role": "prefill", "model": "tiny", "url": p.url,
                           "context_length": 50})
    await register("dec", {"role": "decode", "model": "tiny", "url": d.url,
                           "max_prompt_tokens": 40})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             model="tiny", health_interval=60.0))
    await limits_known_each(client, {"pre": 49, "dec": 40})
    resp = await client.post("/v1/completions", json={"prompt": [[1] * 41], "model": "tiny"})
    assert resp.status == 400
    assert "max_prompt_tokens of worker dec" in error_message("/v1/completions",
                                                              await resp.json())
    assert not p.bodies and not d.bodies


async def limits_known_each(client: Any, want: dict[str, int]) -> None:
    async def known() -> bool:
        workers = await (await client.get("/workers")).json()
        return {w["instance_id"]: w["max_prompt_tokens"]
                for role in ("prefill", "decode") for w in workers[role]} == want

    await wait_for(known)


def _health_answers(url: str, stop: threading.Event) -> int:
    """GET /health in turn until ``stop``, from a thread (a probe on the test's own event loop,
    which the router shares, would not see the loop stall between its requests); each must
    answer 200. Returns how many did."""
    parts = urlsplit(url)
    answered = 0
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        while not stop.is_set():
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            answered += 1
            stop.wait(0.02)
    finally:
        conn.close()
    return answered


@pytest.mark.parametrize("learned", [True, False], ids=["refused", "no-limit-known"])
async def test_health_answers_while_a_huge_body_is_handled_off_the_loop(
        stubs: Any, make_router: Any, learned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's acceptance test: a 30 MB prompt used to cost seconds of router CPU on its
    event loop, with /health stalled. It is parsed in the router's parse threads, never on the
    loop; refused (the workers take 2047 tokens) from its length alone, before any tokenizing.
    How fast /health answers meanwhile is a benchmark's business, not this test's."""
    threads: list[str] = []
    real_parse = router_requests.parse_request

    def parse_request(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(router_requests, "parse_request", parse_request)
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    if learned:
        p.server_info = d.server_info = {"context_length": CONTEXT}
    client = await make_router([p], [d], max_body=64 << 20)
    if learned:
        await limits_known(client, CONTEXT - 1)
    threads.clear()  # nothing before the huge body counts
    huge = json.dumps({"text": "a" * (30 << 20)}).encode()
    stop = threading.Event()
    probe = asyncio.get_running_loop().run_in_executor(None, _health_answers, client.url, stop)
    resp = await client.post("/generate", data=huge,
                             headers={"content-type": "application/json"})
    status = resp.status
    body = await resp.read()
    stop.set()
    assert await probe > 0, "/health answered while the body was handled"
    assert len(threads) == 1 and threads[0].startswith("router-parse"), threads
    if learned:
        assert status == 400
        # "at least N tokens": the refusal came from the text's length, not from tokenizing it
        assert "at least" in json.loads(body)["error"], body[:300]
        assert not p.bodies and not d.bodies
    # else it is passed on: the stub workers refuse a 30 MB body themselves (413)


def test_hashes_made_off_the_loop_are_the_policys() -> None:
    """A large body's prompt is hashed in the parser's thread: the very hashes kv_aware makes,
    and, for a prompt over MAX_ROUTED_BLOCKS blocks, those of its routed prefix only."""
    rng = np.random.default_rng(3)
    for n in (5, 16 * 100 + 7, 16 * MAX_ROUTED_BLOCKS + 40):
        tokens = rng.integers(0, 2**32, n, dtype=np.uint32)
        seed, pre = prompt_hashes(tokens, 16)
        ctx = RouteContext(tokens, None)
        assert pre == ctx.hashes(PromptHasher(16), seed)
        assert len(pre) == min(n // 16, MAX_ROUTED_BLOCKS)
        assert RouteContext(tokens, None, (seed, pre)).hashes(PromptHasher(16), seed) is pre


async def test_a_large_body_is_routed_like_a_small_one(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], max_body=4 << 20)
    text = "x" * (OFF_LOOP_BYTES + 1000)  # parsed in the thread
    resp = await client.post("/debug/route", json={"text": text})
    route = await resp.json()
    assert route["prompt_tokens"] == len(text) + 1
    assert route["prompt_blocks"] == min((len(text) + 1) // 16, MAX_ROUTED_BLOCKS)
    resp = await client.post("/generate", json={"text": text})
    assert resp.status == 200 and d.bodies[0]["text"] == text


async def _etcd_router(start_router: Any, etcd_settings: Any, key_prefix: str) -> Any:
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             model="tiny", health_interval=60.0))

    async def ready() -> bool:
        return (await client.get("/readiness")).status == 200

    await wait_for(ready)
    return client


async def test_limits_of_workers_that_cannot_serve_refuse_nobody(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    """A starting or broken engine's record (not ready, unhealthy) states limits that bound
    nothing: the workers that serve take the request."""
    (p,), (d, starting) = await stubs("prefill"), await stubs("decode", 2)
    await register("p0", {"role": "prefill", "model": "tiny", "url": p.url})
    await register("d0", {"role": "decode", "model": "tiny", "url": d.url})
    await register("d-starting", {"role": "decode", "model": "tiny", "url": starting.url,
                                  "ready": False, "healthy": False, "max_prompt_tokens": 40,
                                  "max_body_bytes": 2000})
    client = await _etcd_router(start_router, etcd_settings, key_prefix)
    await limits_known_each(client, {"p0": None, "d0": None, "d-starting": 40})
    resp = await client.post("/generate", json={"input_ids": [1] * 100, "x": "y" * 3000})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["worker"] == "decode0"
    assert not starting.bodies


async def test_a_request_goes_only_to_the_workers_it_fits(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    """A prompt or body over one decode's limits but under another's goes to the other; once
    no ready worker would take it, it is refused naming the limit."""
    (p,), (small, big) = await stubs("prefill"), await stubs("decode", 2)
    await register("p0", {"role": "prefill", "model": "tiny", "url": p.url})
    await register("d-small", {"role": "decode", "model": "tiny", "url": small.url,
                               "max_prompt_tokens": 40, "max_body_bytes": 2000})
    big_inst = await register("d-big", {"role": "decode", "model": "tiny", "url": big.url,
                                        "max_prompt_tokens": 1000})
    client = await _etcd_router(start_router, etcd_settings, key_prefix)
    await limits_known_each(client, {"p0": None, "d-small": 40, "d-big": 1000})
    for body in ({"input_ids": [1] * 100}, {"input_ids": [1], "x": "y" * 3000}) * 3:
        resp = await client.post("/generate", json=body)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["worker"] == "decode1"
    assert not small.bodies
    # A small request may go to either: both are candidates.
    for _ in range(20):
        assert (await client.post("/generate", json={"input_ids": [1] * 10})).status == 200
    assert small.bodies
    await big_inst.update(ready=False)

    async def big_not_ready() -> bool:
        workers = await (await client.get("/workers")).json()
        return not next(w for w in workers["decode"] if w["instance_id"] == "d-big")["ready"]

    await wait_for(big_not_ready)
    resp = await client.post("/generate", json={"input_ids": [1] * 100})
    assert resp.status == 400
    assert "max_prompt_tokens of worker d-small" in (await resp.json())["error"]
    resp = await client.post("/generate", json={"input_ids": [1], "x": "y" * 3000})
    assert resp.status == 413
    assert "max_body_bytes of worker d-small" in (await resp.json())["error"]


async def test_an_absurd_limit_is_ignored_and_named(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any, register: Any,
        caplog: Any) -> None:
    """A prompt limit below the block size or a body limit below a minimal request is no
    engine's real limit: ignored, shown in a metric, logged once per worker and value."""
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    await register("p0", {"role": "prefill", "model": "tiny", "url": p.url,
                          "context_length": 9})
    dec = await register("d0", {"role": "decode", "model": "tiny", "url": d.url,
                                "max_prompt_tokens": 8, "max_body_bytes": 64})
    caplog.set_level("WARNING", logger="router.limits")
    client = await _etcd_router(start_router, etcd_settings, key_prefix)
    for _ in range(3):
        resp = await client.post("/generate", json={"text": "a prompt longer than 8 tokens"})
        assert resp.status == 200, await resp.text()
    await dec.update(note="written again")

    async def rewritten() -> bool:
        workers = await (await client.get("/workers")).json()
        return workers["decode"][0]["ignored_limits"] == {"max_prompt_tokens": 8,
                                                          "max_body_bytes": 64} \
            and client.app.state.pools.find("d0").record.get("note") == "written again"

    await wait_for(rewritten)
    assert (await client.post("/generate", json={"input_ids": [1] * 50})).status == 200
    lines = await client.metric_lines("kvatlas_router_worker_limit_ignored{")
    assert sorted(lines) == sorted([
        'kvatlas_router_worker_limit_ignored{field="context_length",instance="p0",value="9"} 1.0',
        'kvatlas_router_worker_limit_ignored{field="max_prompt_tokens",instance="d0",value="8"} '
        '1.0',
        'kvatlas_router_worker_limit_ignored{field="max_body_bytes",instance="d0",value="64"} '
        '1.0']), lines
    logged = [r.getMessage() for r in caplog.records if r.name == "router.limits"]
    assert len(logged) == 3, logged
    assert any("d0 states max_body_bytes 64" in m for m in logged), logged


async def test_an_unhealthy_workers_limit_stops_counting(stubs: Any, make_router: Any) -> None:
    """A worker that fails its health checks takes nothing: its limit, learned while it was
    healthy, no longer decides what the router takes (a prompt only it took is refused now,
    naming the healthy worker's limit)."""
    (p,), (d, failing) = await stubs("prefill"), await stubs("decode", 2)
    d.server_info = {"context_length": 32}
    failing.server_info = {"context_length": 201}
    client = await make_router([p], [d, failing], health_interval=0.02)

    async def learned() -> bool:
        workers = await (await client.get("/workers")).json()
        return [w["max_prompt_tokens"] for w in workers["decode"]] == [31, 200]

    await wait_for(learned)
    resp = await client.post("/generate", json={"input_ids": [1] * 100})
    assert resp.status == 200 and (await resp.json())["worker"] == "decode1"
    failing.health_status = 500

    async def unhealthy() -> bool:
        workers = await (await client.get("/workers")).json()
        return not workers["decode"][1]["healthy"]

    await wait_for(unhealthy)
    resp = await client.post("/generate", json={"input_ids": [1] * 100})
    assert resp.status == 400, await resp.text()
    assert "at most 31 are taken (context_length 32 of worker" in (await resp.json())["error"]
    assert (await client.post("/generate", json={"input_ids": [1] * 20})).status == 200
