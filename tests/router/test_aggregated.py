"""Aggregated pools: workers that serve whole requests (sglang-router's regular mode,
``--worker-urls``, and ``aggregated`` instance records). Two real reference engines in monolithic
mode behind the router: the body reaches one of them unchanged (no bootstrap fields), kv_aware
keeps a prefix on the engine that computed it, a dead worker is retried on the other, and
sglang-router's regular-mode command line is taken unchanged."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from waiting import wait_until_sync

from kvatlas.etcd_proc import free_port
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _spawn(port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", "monolithic",
         "--model", "tiny", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def _healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"engine {url} exited with {proc.returncode}"
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def engines() -> Iterator[list[str]]:
    """Two monolithic reference engines (real processes), as base URLs."""
    ports = [free_port(), free_port()]
    procs = [_spawn(p) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_until_sync(lambda url=url, proc=proc: _healthy(url, proc),
                            what=f"{url} answers /health 200", timeout=60.0, interval=0.1)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=15)


def _body(ids: list[int], max_new: int = 8, **extra: Any) -> dict[str, Any]:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                  "ignore_eos": True}, **extra}


async def _direct(url: str, body: dict[str, Any]) -> list[int]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["output_ids"]


def _config(urls: list[str], **kw: Any) -> RouterConfig:
    """``router_config``'s test settings, with ``urls`` as the aggregated workers."""
    kw.setdefault("retry_initial_backoff", 0.005)
    kw.setdefault("health_interval", 60.0)
    kw.setdefault("tokenizers", {None: "byte"})  # the reference engine's ids
    return RouterConfig(worker_urls=list(urls), **kw)


async def test_a_request_goes_whole_to_one_worker_and_a_prefix_stays_there(
        engines: list[str], start_router: Any) -> None:
    router = await start_router(_config(engines, explain_routes=True))
    shared = [40 + i % 200 for i in range(16 * 6)]  # six blocks every prompt starts with
    want = await _direct(engines[0], _body(shared + [7, 8, 9]))
    chosen = []
    for tail in ([7, 8, 9], [10, 11], [12, 13, 14, 15]):
        async with router.post("/generate", json=_body(shared + tail)) as r:
            assert r.status == 200, await r.text()
            route = json.loads(r.headers["x-kvatlas-route"])
            assert "decode" not in route and "prefill" not in route, route
            chosen.append(route["worker"])
            answer = await r.json()
        if tail == [7, 8, 9]:
            # The reference engine's greedy tokens: the body reached it as sent.
            assert answer["output_ids"] == want
        else:
            assert route["matched_blocks"] == 6, route
    assert len(set(chosen)) == 1, f"one prefix went to several workers: {chosen}"
    async with router.get("/readiness") as r:
        ready = await r.json()
        assert r.status == 200, ready
        assert ready["aggregated"]["available"] == 2
    async with router.post("/debug/route", json=_body(shared + [1])) as r:
        shown = await r.json()
        assert shown["shape"] == "aggregated" and shown["worker"]["instance_id"] == chosen[0]
        assert shown["matched_blocks"] == 6 and len(shown["candidates"]) == 2


async def test_streams_and_openai_routes_reach_one_worker(engines: list[str],
                                                           start_router: Any) -> None:
    router = await start_router(_config(engines))
    async with router.post("/generate", json=_body([5, 6, 7, 8], 4, stream=True)) as r:
        assert r.status == 200
        text = await r.text()
    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    async with router.post("/v1/completions", json={
            "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0}) as r:
        body = await r.json()
        assert r.status == 200, body
        assert body["usage"]["completion_tokens"] == 4


async def test_a_dead_worker_is_retried_on_the_other(engines: list[str],
                                                     start_router: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = await start_router(_config([dead, engines[1]], policy="round_robin"))
    for _ in range(4):
        async with router.post("/generate", json=_body([1, 2, 3])) as r:
            assert r.status == 200, await r.text()


def test_sglang_routers_regular_mode_command_line_works_unchanged() -> None:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    args = parser.parse_args([
        "--worker-urls", "http://10.0.0.1:30000", "http://10.0.0.2:30000",
        "--policy", "cache_aware", "--cache-threshold", "0.3",
        "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
        "--eviction-interval-secs", "60", "--max-tree-size", "67108864",
        "--host", "127.0.0.1", "--port", "30000"])
    cfg = RouterConfig.from_cli_args(args)
    assert cfg.worker_urls == ["http://10.0.0.1:30000", "http://10.0.0.2:30000"]
    assert cfg.policy == "kv_aware" and cfg.cache_threshold == 0.3
    assert cfg.balance_abs_threshold == 64 and cfg.balance_rel_threshold == 1.5
    with pytest.raises(ValueError, match="cache_threshold"):
        RouterConfig(worker_urls=["http://10.0.0.1:1"], cache_threshold=1.5)
    with pytest.raises(ValueError, match="worker URL"):
        RouterConfig(worker_urls=["not a url"])
