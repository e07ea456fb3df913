"""The big PD correctness test with real rank processes (``kvatlas engine serve``, gloo, ZMQ):
>= 100 random prompts with shared prefixes, >= 32 in flight, through every (prefill tp, decode tp)
combination and a prefill with dp 2 (both DP policies): the decode's tokens equal the monolithic
engine's, and the prefill reuses its prefix cache. Plus a two-node prefill simulated on this
machine, where node 1 is started with the wrong bootstrap port and must take node 0's."""
from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from engine_helpers import shared_prefix_prompts
from pd_helpers import monolithic, new_room, pd_body
from pd_procs import Proc

from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(120)

N_PROMPTS = 100
IN_FLIGHT = 40
COMBOS = [  # (prefill args, decode args, model)
    (("--tp", "1"), ("--tp", "1"), "tiny"),
    (("--tp", "2"), ("--tp", "1"), "tiny"),
    (("--tp", "1"), ("--tp", "2"), "tiny"),
    (("--tp", "2"), ("--tp", "2"), "tiny"),
    (("--tp", "4"), ("--tp", "2"), "tiny-kv4"),
    (("--tp", "1", "--dp", "2"), ("--tp", "1"), "tiny"),
    (("--tp", "2", "--dp", "2", "--load-balance-method", "round_robin"), ("--tp", "1"), "tiny"),
]


def _workload() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(77)
    prompts = shared_prefix_prompts(N_PROMPTS, seed=31, n_bases=8, base_len=(20, 70),
                                    tail_len=(1, 30))
    return prompts, [rng.randint(1, 5) for _ in prompts]


_REFERENCE: dict[str, list[list[int]]] = {}


def reference(model: str) -> list[list[int]]:
    if model not in _REFERENCE:
        prompts, _ = _workload()
        _REFERENCE[model] = monolithic(prompts, _reference_max_new(), model)
    return _REFERENCE[model]


def _combo_id(c: tuple) -> str:
    return f"P[{' '.join(c[0])}]-D[{' '.join(c[1])}]"


@pytest.fixture(scope="module", params=COMBOS, ids=_combo_id)
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[Proc, Proc, str]]:
    p_args, d_args, model = request.param
    prefill = Proc("prefill", *p_args, model=model)
    decode = Proc("decode", *d_args, model=model)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode, model
    finally:
        prefill.stop()
        decode.stop()


BATCH = 4
"""Every fourth group of this many prompts goes as one batched request (a room per prompt)."""


async def run_workload(prefill: Proc, decode: Proc) -> tuple[list[Any], int, int]:
    prompts, max_new = _workload()
    sem = asyncio.Semaphore(IN_FLIGHT)
    in_flight = peak = 0
    cached = 0

    async def one(s: aiohttp.ClientSession, group: list[tuple[list[int], int]]) -> list[Any]:
        nonlocal in_flight, peak, cached
        if len(group) == 1:
            body = pd_body(group[0][0], group[0][1], prefill.bport)
        else:  # a batch shares sampling params: the group's prompts all ask for the same
            body = {**pd_body(group[0][0], group[0][1], prefill.bport),
                    "input_ids": [ids for ids, _ in group],
                    "bootstrap_room": [new_room() for _ in group]}
        async with sem:
            in_flight += len(group)
            peak = max(peak, in_flight)
            try:
                async with asyncio.TaskGroup() as tg:
                    p = tg.create_task(s.post(prefill.url + "/generate", json=body))
                    d = tg.create_task(s.post(decode.url + "/generate", json=body))
                pr, dr = p.result(), d.result()
                pbody, dbody = await pr.json(), await dr.json()
            finally:
                in_flight -= len(group)
            assert pr.status == 200, pbody
            assert dr.status == 200, dbody
            if len(group) == 1:
                pbody, dbody = [pbody], [dbody]
            cached += sum(x["meta_info"]["cached_tokens"] for x in pbody)
            return [x["output_ids"] for x in dbody]

    groups: list[list[tuple[list[int], int]]] = []
    for start in range(0, len(prompts), BATCH):
        chunk = list(zip(prompts[start:start + BATCH], max_new[start:start + BATCH]))
        if (start // BATCH) % 4 == 0:
            n = chunk[0][1]
            groups.append([(ids, n) for ids, _ in chunk])
        else:
            groups.extend([c] for c in chunk)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200)) as s:
        got = await asyncio.gather(*(one(s, g) for g in groups))
    return [ids for answer in got for ids in answer], peak, cached


def _reference_max_new() -> list[int]:
    """The max_new_tokens each prompt is sent with (a batch's prompts share its first's)."""
    _, max_new = _workload()
    out = list(max_new)
    for start in range(0, len(out), BATCH):
        if (start // BATCH) % 4 == 0:
            out[start:start + BATCH] = [max_new[start]] * len(out[start:start + BATCH])
    return out


async def test_pd_tokens_equal_monolithic(cluster: tuple[Proc, Proc, str]) -> None:
    prefill, decode, model = cluster
    got, peak, cached = await run_workload(prefill, decode)
    want = reference(model)
    mismatched = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not mismatched, f"{len(mismatched)} requests differ, e.g. #{mismatched[0]}"
    assert peak >= 32, f"only {peak} requests were in flight at once"
    assert cached > 0, "the prefill never hit its prefix cache"
    async with aiohttp.ClientSession() as s:
        async with s.get(decode.url + "/debug/pd") as r:
            doc = await r.json()
    assert doc["ok"] == N_PROMPTS and doc["failed"] == 0
    assert doc["kv_pages_free"] == doc["kv_pages_total"]
    # OpenAI requests take the same path (on a DP prefill, forwarded on their own endpoint).
    async with aiohttp.ClientSession() as s:
        for room in (2, 3):  # both DP groups under follow_bootstrap_room
            # ignore_eos: sampled at temperature 1, an end token may come first (once seen in CI).
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                    "ignore_eos": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bport,
                    "bootstrap_room": room}
            pr, dr = await asyncio.gather(
                s.post(prefill.url + "/v1/chat/completions", json=body),
                s.post(decode.url + "/v1/chat/completions", json=body))
            answer = await dr.json()
            assert (pr.status, dr.status) == (200, 200), answer
            assert answer["usage"]["completion_tokens"] == 3


async def test_two_node_prefill_takes_node0_bootstrap_port() -> None:
    init = f"127.0.0.1:{free_port()}"
    node0 = Proc("prefill", "--tp", "2", "--nnodes", "2", "--node-rank", "0",
                 "--dist-init-addr", init)
    # node 1 is told a bootstrap port where nothing listens: it must use node 0's broadcast
    node1 = Proc("prefill", "--tp", "2", "--nnodes", "2", "--node-rank", "1",
                 "--dist-init-addr", init)
    decode = Proc("decode")
    try:
        node0.wait_ready()
        decode.wait_ready()
        assert node1.proc.poll() is None
        got, _, _ = await run_workload_subset(node0, decode, 12)
        assert got == reference("tiny")[:12]
    finally:
        for p in (node1, node0, decode):
            p.stop()


async def run_workload_subset(prefill: Proc, decode: Proc, n: int) -> tuple[list[Any], int, int]:
    prompts, _ = _workload()
    max_new = _reference_max_new()
    async with aiohttp.ClientSession() as s:
        out = []
        for ids, m in zip(prompts[:n], max_new[:n]):
            body = pd_body(ids, m, prefill.bport)
            pr, dr = await asyncio.gather(s.post(prefill.url + "/generate", json=body),
                                          s.post(decode.url + "/generate", json=body))
            assert pr.status == 200 and dr.status == 200, await dr.text()
            out.append((await dr.json())["output_ids"])
    return out, 0, 0
