"""A decode asked (``X-Kvatlas-Prefill: local``, no bootstrap fields) prefills a request itself:
its output equals the monolithic engine's, a later turn hits the decode's own prefix cache, PD
requests on the same decode are served as before, the header is refused with bootstrap fields
and on a decode started without --local-prefill, and with etcd the decode's record says
``local_prefill`` and its locally prefilled blocks are indexed under its lease."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from engine_helpers import wait_indexed
from pd_helpers import Pair, dual, monolithic, pd_body, pd_config, start_pair
from pd_procs import Proc

from engine.pd.decode import create_decode_app
from engine.pd.local import PREFILL_HEADER
from engine.pd.registration_decode import decode_record
from engine.ranks.dist import RankInfo
from index.etcd import EtcdClient
from index.hashing import BASE_SEED, block_hashes
from index.keys import KeyLayout
from index.record import InstanceRecord
from index.segments import held_blocks

pytestmark = pytest.mark.timeout(90)

LOCAL = {PREFILL_HEADER: "local"}


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    """An in-process PD pair whose decode was started with --local-prefill."""
    p = await start_pair(decode_over={"local_prefill": True})
    try:
        yield p
    finally:
        await p.decode.close()
        await p.prefill.close()


def local_body(ids: list[int], max_new: int, stream: bool = False) -> dict[str, Any]:
    return {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                "ignore_eos": True}}


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with s.post(url, json=body, headers=headers) as r:
        if body.get("stream") and r.status == 200:
            return r.status, await r.text()
        return r.status, await r.json()


def last_event(raw: str) -> dict[str, Any]:
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", raw
    return json.loads(events[-2])  # type: ignore[no-any-return]


async def test_local_prefill_equals_monolithic_and_reuses_the_decode_cache(pair: Pair) -> None:
    base = [256, *b"a conversation whose first turn fills several KV pages of sixteen"]
    prompts = [base, base + list(b" and a second turn"), [256, *b"another prompt"]]
    max_new = [5, 4, 6]
    want = monolithic(prompts, max_new)
    url = pair.d_url + "/generate"
    async with aiohttp.ClientSession() as s:
        st, first = await post(s, url, local_body(prompts[0], max_new[0]), LOCAL)
        assert st == 200, first
        assert first["output_ids"] == want[0]
        assert first["meta_info"]["cached_tokens"] == 0
        # the second turn shares the first's full pages: they are in the decode's cache now
        st, raw = await post(s, url, local_body(prompts[1], max_new[1], stream=True), LOCAL)
        assert st == 200, raw
        second = last_event(raw)
        assert second["output_ids"] == want[1]
        assert second["meta_info"]["cached_tokens"] >= 16 * (len(base) // 16)
        st, third = await post(s, url, local_body(prompts[2], max_new[2]), LOCAL)
        assert st == 200 and third["output_ids"] == want[2], third
    cache = pair.ds.replica.cache
    assert cache.blocks(), "nothing the decode prefilled was cached"
    assert cache.available() == pair.ds.replica.pool.num_pages, "pages still referenced"


async def test_openai_routes_prefill_locally(pair: Pair) -> None:
    ids = [256, *b"an OpenAI completion served whole by the decode"]
    [want] = monolithic([ids], [5])
    async with aiohttp.ClientSession() as s:
        st, native = await post(s, pair.d_url + "/generate", local_body(ids, 5), LOCAL)
        assert st == 200 and native["output_ids"] == want, native
        body = {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0}
        st, doc = await post(s, pair.d_url + "/v1/completions", body, LOCAL)
        assert st == 200, doc
        assert doc["choices"][0]["text"] == native["text"]
        assert doc["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello decode"}],
                "max_tokens": 3, "temperature": 0}
        st, doc = await post(s, pair.d_url + "/v1/chat/completions", chat, LOCAL)
        assert st == 200 and doc["usage"]["completion_tokens"] == 3, doc
        # without the header, an OpenAI request without bootstrap fields is refused as before
        st, doc = await post(s, pair.d_url + "/v1/completions", body)
        assert st == 400 and "bootstrap_host" in json.dumps(doc), doc


async def test_pd_requests_beside_local_ones_still_equal_monolithic(pair: Pair) -> None:
    prompts = [[256, *b"a PD prompt on a decode that also prefills"],
               [256, *b"a PD prompt on a decode that also prefills, again"]]
    want = monolithic(prompts, [6, 6])
    async with aiohttp.ClientSession() as s:
        st, doc = await post(s, pair.d_url + "/generate", local_body(prompts[0], 6), LOCAL)
        assert st == 200 and doc["output_ids"] == want[0], doc
        cached_before = set(pair.ds.replica.cache.blocks())
        got = []
        for ids in prompts:
            (ps, pbody), (ds, dbody) = await dual(s, pair.p_url, pair.d_url,
                                                  pd_body(ids, 6, pair.bport))
            assert ps == 200 and ds == 200, (pbody, dbody)
            got.append(dbody["output_ids"])
    assert got == want
    # KV that arrived by transfer does not enter the decode's cache
    assert set(pair.ds.replica.cache.blocks()) == cached_before
    assert pair.ds.replica.cache.available() == pair.ds.replica.pool.num_pages


async def test_the_header_is_refused_with_bootstrap_fields_or_another_value(pair: Pair) -> None:
    ids = [256, *b"conflicting"]
    async with aiohttp.ClientSession() as s:
        st, doc = await post(s, pair.d_url + "/generate", pd_body(ids, 3, pair.bport), LOCAL)
        assert st == 400 and "not both" in doc["error"], doc
        st, doc = await post(s, pair.d_url + "/generate", local_body(ids, 3),
                             {PREFILL_HEADER: "remote"})
        assert st == 400 and "'local'" in doc["error"], doc
        # neither header nor bootstrap fields: the refusal it always was
        st, doc = await post(s, pair.d_url + "/generate", local_body(ids, 3))
        assert st == 400 and "bootstrap_host" in doc["error"], doc
    # refused before any room opened
    assert pair.ds.rooms.counts() == {"in_flight": 0, "done": 0, "failed": 0}


@pytest.fixture
async def no_local_decode() -> AsyncIterator[TestServer]:
    server = TestServer(create_decode_app(pd_config("decode", local_prefill=False)),
                        host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


async def test_no_local_prefill_refuses_the_header(no_local_decode: TestServer) -> None:
    url = str(no_local_decode.make_url("/generate"))
    async with aiohttp.ClientSession() as s:
        st, doc = await post(s, url, local_body([256, 1, 2, 3], 2), LOCAL)
    assert st == 400 and "--local-prefill" in doc["error"], doc


def test_the_record_says_whether_the_decode_prefills_locally() -> None:
    info = RankInfo(0, 1, 1, 1)
    on = decode_record(pd_config("decode", instance_id="dec-on", local_prefill=True), info)
    off = decode_record(pd_config("decode", instance_id="dec-off", local_prefill=False), info)
    assert on.local_prefill is True and on.block_size == 16
    assert off.local_prefill is False and off.block_size is None
    # with its prefix cache off it indexes nothing, so it states no block size either
    cfg = pd_config("decode", instance_id="dec-bare", local_prefill=True)
    bare = replace(cfg, engine=replace(cfg.engine, enable_prefix_cache=False))
    assert not bare.caches_prefixes and decode_record(bare, info).block_size is None
    assert InstanceRecord.from_json(on.to_json()).local_prefill is True
    assert pd_config("decode").local_prefill is False  # opt-in: PD fleets stay disaggregated
    with pytest.raises(ValueError, match="decode instances"):
        pd_config("prefill", local_prefill=True)


async def test_with_etcd_the_locally_prefilled_blocks_are_indexed_under_the_decode(
        etcd_endpoint: str, key_prefix: str, etcd: EtcdClient) -> None:
    layout = KeyLayout(prefix=key_prefix)
    common = ["--etcd", etcd_endpoint, "--etcd-prefix", key_prefix, "--lease-ttl", "30"]
    prefill = Proc("prefill", *common, "--instance-id", "pre-l")
    decode = Proc("decode", *common, "--instance-id", "dec-l", "--local-prefill")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        kv = await etcd.get(layout.instance("dec-l"))
        assert kv is not None
        rec = InstanceRecord.from_json(kv.value)
        assert rec.role == "decode" and rec.local_prefill is True and rec.block_size == 16
        ids = [256, *b"a prompt the decode prefills itself, long enough for two blocks"]
        pd_ids = [256, *b"a prompt the prefill computes and sends to the decode, two blocks"]
        [want_local, want_pd] = monolithic([ids, pd_ids], [4, 4])
        async with aiohttp.ClientSession() as s:
            st, doc = await post(s, decode.url + "/generate", local_body(ids, 4), LOCAL)
            assert st == 200 and doc["output_ids"] == want_local, doc
            assert prefill.bport is not None
            (ps, pbody), (ds, dbody) = await dual(s, prefill.url, decode.url,
                                                  pd_body(pd_ids, 4, prefill.bport))
            assert ps == 200 and ds == 200 and dbody["output_ids"] == want_pd, (pbody, dbody)
        await wait_indexed(etcd, layout, "dec-l", ids)
        _, segments = await etcd.get_prefix(layout.blocks_prefix("tiny", "dec-l"))
        # the transferred prompt is not the decode's: only the prefill holds it
        assert not set(held_blocks(kv.value for kv in segments)) & set(
            block_hashes(pd_ids, 16, BASE_SEED))
        assert {kv.lease for kv in segments} == {kv.lease}
        decode.stop()  # a clean stop revokes the lease: record and blocks go
        _, left = await etcd.get_prefix(layout.blocks_prefix("tiny", "dec-l"))
        assert not left, "the decode's blocks outlived its lease"
    finally:
        decode.stop()
        prefill.stop()


async def test_a_tp2_decode_prefills_locally_with_its_ranks_in_lockstep() -> None:
    """Every TP rank replicates the local request and its cache hit (the scheduler's ``add``),
    so the sharded forward still equals the monolithic output on a second turn."""
    decode = Proc("decode", "--tp", "2", "--local-prefill")
    try:
        decode.wait_ready()
        base = [256, *b"a tensor-parallel decode prefilling a prompt of two pages"]
        prompts = [base, base + list(b", then a follow-up")]
        want = monolithic(prompts, [5, 5])
        async with aiohttp.ClientSession() as s:
            got = []
            for ids in prompts:
                st, doc = await post(s, decode.url + "/generate", local_body(ids, 5), LOCAL)
                assert st == 200, doc
                got.append(doc)
        assert [d["output_ids"] for d in got] == want
        assert got[1]["meta_info"]["cached_tokens"] >= 16 * (len(base) // 16)
    finally:
        decode.stop()
