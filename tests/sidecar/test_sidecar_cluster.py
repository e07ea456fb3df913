"""A sidecar'd cluster of real processes behaves like a kvatlas one: the router's greedy output
equals the one-process engine's, a shared prefix goes to its holder with index blocks, and the
rank table in etcd is what the engines' bootstrap servers answer."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from conftest import SidecarCluster
from waiting import wait_until

from engine.config import get_model_config
from engine.protocol import encode_text
from engine.runner import build_scheduler, run_to_completion
from engine.sampling import SamplingParams
from engine.scheduler import Request
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, loads
from index.record import InstanceRecord

pytestmark = pytest.mark.slow

SAMPLING = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
SYSTEM = ("You are a careful assistant who answers in one sentence and cites nothing at all, "
          "whatever the user asks of you today. ")
ROUTE = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def reference(prompts: list[str]) -> dict[str, list[int]]:
    sched = build_scheduler(get_model_config("tiny"), num_pages=2048)
    reqs = [Request(f"r{i}", encode_text(p, "text"), SamplingParams(**SAMPLING))
            for i, p in enumerate(prompts)]
    done = run_to_completion(sched, reqs)
    return {p: done[r.rid].output_ids for p, r in zip(prompts, reqs)}


async def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(url, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


async def get(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        async with s.get(url) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def records(cluster: SidecarCluster) -> dict[str, InstanceRecord]:
    layout = KeyLayout(cluster.prefix)
    async with EtcdClient(EtcdSettings.from_text(cluster.etcd)) as client:
        _, kvs = await client.get_prefix(layout.instances_prefix())
    return {layout.parse_instance(kv.key): InstanceRecord.from_json(kv.value) for kv in kvs}


async def test_greedy_output_through_the_router_equals_monolithic(
        shared_cluster: SidecarCluster) -> None:
    prompts = [f"{SYSTEM}Question {i}: what is {i} plus {i}?" for i in range(6)]
    want = reference(prompts)
    router = shared_cluster.router.url
    answers = await asyncio.gather(*(post(f"{router}/generate",
                                          {"text": p, "sampling_params": SAMPLING})
                                     for p in prompts))
    for p, (status, doc) in zip(prompts, answers):
        assert status == 200, (doc, shared_cluster.logs())
        assert doc["output_ids"] == want[p], p


async def test_records_are_routable_and_name_what_the_engine_serves(
        shared_cluster: SidecarCluster) -> None:
    recs = await records(shared_cluster)
    assert sorted(recs) == ["d0", "p0", "p1"]
    for p in shared_cluster.prefills:
        rec = recs[p.name]
        assert (rec.role, rec.url, rec.bootstrap_port, rec.block_size, rec.page_size) == (
            "prefill", p.url, p.bport, 16, 16)
        assert rec.ready and rec.healthy and rec.source == "sidecar"
        assert (rec.expected_ranks, rec.registered_ranks) == (1, 1)
        assert isinstance(rec.tokenizer, dict) and rec.tokenizer["source"] == "byte"
    assert recs["d0"].role == "decode" and recs["d0"].url == shared_cluster.decode.url


async def test_mirrored_rank_table_equals_the_engines_route_answers(
        shared_cluster: SidecarCluster) -> None:
    layout = KeyLayout(shared_cluster.prefix)
    async with EtcdClient(EtcdSettings.from_text(shared_cluster.etcd)) as client:
        for p in shared_cluster.prefills:
            _, kvs = await client.get_prefix(layout.ranks_prefix(p.name))
            mirrored = {layout.parse_rank(kv.key)[1]: loads(kv.value) for kv in kvs}
            status, topo = await get(f"{p.bootstrap_url}/route?" + "&".join(
                f"{k}=-1" for k in ROUTE))
            assert status == 200
            n = topo["dp_size"] * topo["attn_cp_size"] * topo["attn_tp_size"] * topo["pp_size"]
            assert len(mirrored) == n
            for cell, value in mirrored.items():
                status, addr = await get(f"{p.bootstrap_url}/route?" + "&".join(
                    f"{k}={v}" for k, v in zip(ROUTE, cell)))
                assert status == 200
                assert (value["rank_ip"], value["rank_port"]) == (addr["rank_ip"],
                                                                  addr["rank_port"])


async def test_second_request_of_a_shared_prefix_goes_to_its_holder_with_index_blocks(
        shared_cluster: SidecarCluster) -> None:
    router = shared_cluster.router.url
    prefix = SYSTEM * 4 + "Shared document for the holder test. "
    status, first = await post(f"{router}/generate", {"text": prefix + "First question?",
                                                      "sampling_params": SAMPLING})
    assert status == 200, first
    body = {"text": prefix + "Second question?"}

    async def indexed() -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(route, its best candidate) once the holder's KV events reached the router."""
        status, route = await post(f"{router}/debug/route", body)
        assert status == 200, route
        best = max(route["candidates"], key=lambda c: c["index_blocks"])
        return (route, best) if best["index_blocks"] > 0 else None
    route, best = await wait_until(indexed, what="the router's index holds the prompt's blocks",
                                   interval=0.1, detail=shared_cluster.logs)
    holder = best["instance_id"]
    assert route["prefill"]["instance_id"] == holder, route
    status, second = await post(f"{router}/generate", {**body, "sampling_params": SAMPLING})
    assert status == 200
    assert second["meta_info"]["cached_tokens"] >= 16 * best["index_blocks"], second
