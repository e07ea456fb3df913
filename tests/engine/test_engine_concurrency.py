"""Continuous batching must not change results: 32 requests in flight at once give the same tokens
as the same requests one at a time (greedy and seeded sampling, shared prefixes, small token
budget so prefill chunks and decode steps of different requests share forwards)."""
from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from engine_helpers import shared_prefix_prompts

from engine.http_common import STATE_KEY
from engine.serve_config import EngineServerConfig
from engine.server import create_app

pytestmark = pytest.mark.timeout(90)


def _bodies() -> list[dict[str, Any]]:
    rng = random.Random(3)
    out = []
    for i, ids in enumerate(shared_prefix_prompts(32, seed=21, n_bases=4, tail_len=(1, 50))):
        sp: dict[str, Any] = {"max_new_tokens": rng.randint(4, 20), "ignore_eos": True}
        if i % 2:
            sp.update(temperature=0.9, top_k=50, top_p=0.95, seed=1000 + i)
        else:
            sp.update(temperature=0)
        out.append({"input_ids": ids, "sampling_params": sp})
    return out


async def test_32_in_flight_equal_one_at_a_time(aiohttp_client: Any) -> None:
    bodies = _bodies()
    seq_client = await aiohttp_client(create_app(EngineServerConfig()))
    one_by_one = []
    for body in bodies:
        r = await seq_client.post("/generate", json=body)
        assert r.status == 200
        one_by_one.append((await r.json())["output_ids"])

    conc_client = await aiohttp_client(create_app(EngineServerConfig(max_batch_tokens=48)))
    sched = conc_client.server.app[STATE_KEY].engine.scheduler
    seen_batch = 0

    async def watch() -> None:
        nonlocal seen_batch
        while True:
            seen_batch = max(seen_batch, len(sched.running))
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    try:
        resps = await asyncio.gather(*(conc_client.post("/generate", json=b) for b in bodies))
        together = [(await r.json())["output_ids"] for r in resps]
    finally:
        watcher.cancel()
    assert all(r.status == 200 for r in resps)
    assert together == one_by_one
    assert seen_batch >= 8, f"requests never overlapped (max running {seen_batch})"
    assert sched.cache.pages_in_use == 0
