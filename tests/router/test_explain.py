"""Why a request went where it went: the opt-in ``X-Kvatlas-Route`` header on real answers (plain
and streamed), the regret metrics of kv_aware's picks, and the engines' reported cached tokens
beside the router's prediction."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest
from router_stubs import encode_text

from index.table import BlockTable
from router.breaker import CircuitBreaker
from router.config import RouterConfig
from router.explain import last_cached_tokens, reported_cached_tokens
from router.kv_aware import KvAware
from router.policy import RouteContext
from router.workers import Worker

TEXT = "<|system|>\nexplain this route " + "with enough words for blocks " * 8


async def sample(client: Any, name: str) -> float:
    lines = [ln for ln in await client.metric_lines(name) if not ln.startswith("#")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


async def test_the_header_is_opt_in_and_names_the_pair_and_the_cost_terms(
        stubs: Any, make_router: Any) -> None:
    ps, (d,) = await stubs("prefill", 2), await stubs("decode")
    client = await make_router(ps, [d], policy="kv_aware")
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 2}}
    plain = await client.post("/generate", json=body)
    assert plain.status == 200 and "x-kvatlas-route" not in plain.headers
    asked = await client.post("/generate", json=body, headers={"X-Kvatlas-Explain": "1"})
    assert asked.status == 200
    doc = json.loads(asked.headers["x-kvatlas-route"])
    assert doc["prefill"] in {"static-127.0.0.1-%d" % p.port for p in ps}
    assert doc["decode"] == f"static-127.0.0.1-{d.port}"
    assert doc["policy"] == "kv_aware" and doc["block_size"] == 16 and doc["candidates"] == 2
    assert doc["prompt_blocks"] == len(encode_text(TEXT)) // 16 > 0
    # The second request of the prompt: its blocks are predicted where the first went.
    assert doc["matched_blocks"] == doc["prompt_blocks"] == doc["best_matched_blocks"]
    assert doc["missed_blocks"] == doc["prompt_blocks"] - doc["credited_blocks"]
    assert doc["cost"] == pytest.approx(doc["missed_blocks"] * doc["overlap_weight"]
                                        + doc["load_blocks"], abs=1e-3)
    stream = await client.post("/generate", json={**body, "stream": True},
                               headers={"x-kvatlas-explain": "true"})
    assert stream.status == 200 and json.loads(stream.headers["x-kvatlas-route"])["decode"]
    await stream.read()


async def test_the_flag_explains_every_answer(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], explain_routes=True)
    resp = await client.post("/generate", json={"text": "hello"})
    assert resp.status == 200 and json.loads(resp.headers["x-kvatlas-route"])["prompt_blocks"] == 0


async def test_engine_reported_cached_tokens_are_counted_beside_the_prediction(
        stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    d.cached_tokens = 48
    client = await make_router([p], [d], policy="kv_aware")
    body = {"text": TEXT, "sampling_params": {"max_new_tokens": 2}}
    for stream in (False, True):
        resp = await client.post("/generate", json={**body, "stream": stream})
        assert resp.status == 200
        await resp.read()
    # Two answers of 48 each: a stream repeats its running count in every event, counted once.
    assert await sample(client, "kvatlas_router_engine_cached_tokens_total") == 96
    predicted = await sample(client, "kvatlas_router_prefix_hit_tokens_total")
    assert predicted == len(encode_text(TEXT)) // 16 * 16  # the second request's prediction


def test_regret_is_the_best_overlap_minus_the_chosen_one() -> None:
    """Load can outweigh a longer overlap: the pick's regret says by how many blocks."""
    table = BlockTable()
    ws = [Worker(f"p{i}", "prefill", f"http://127.0.0.1:{9000 + i}", CircuitBreaker())
          for i in range(2)]
    kv = KvAware(RouterConfig(), lambda h, m: table.lookup(h), random.Random(1))
    hashes = RouteContext(encode_text(TEXT)).hashes(kv.hasher, kv.seed)
    table.apply_add("p0", hashes[:2])
    ws[0].load = 50  # busy: its 2-block overlap does not pay for its queue
    choice = kv.select(ws, RouteContext(encode_text(TEXT)))
    assert choice.worker.instance_id == "p1"
    assert (choice.best_matched, choice.matched_blocks) == (2, 0)


async def test_regret_metrics_are_exposed(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d], policy="kv_aware")
    resp = await client.post("/generate", json={"text": TEXT})
    assert resp.status == 200
    assert await sample(client, "kvatlas_router_route_regret_blocks_count") == 1
    assert await sample(client, "kvatlas_router_not_best_overlap_picks_total") == 0


def test_cached_tokens_are_read_without_parsing_the_answer() -> None:
    assert reported_cached_tokens(b'{"meta_info": {"cached_tokens": 32}}') == 32
    batch = b'[{"meta_info": {"cached_tokens": 16}}, {"meta_info": {"cached_tokens": 8}}]'
    assert reported_cached_tokens(batch) == 24
    openai = b'{"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}'
    assert reported_cached_tokens(openai) == 64 and reported_cached_tokens(b"{}") == 0
    assert last_cached_tokens(b'data: {"cached_tokens": 5}\n\ndata: {"cached_tokens": 7}', 0) == 7
    assert last_cached_tokens(b"data: [DONE]", 7) == 7
