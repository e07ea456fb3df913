"""vLLM's PD protocol through the router (real HTTP to real stub workers; push pairs registered
in real etcd): what each half is sent, pull's order, push's identity, retries, hang-ups, and
SGLang's and vLLM's pairs side by side."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from router_stubs import StubWorker, router_config
from waiting import wait_until

from router.config import RouterConfig

PULL_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
             "remote_request_id", "remote_host", "remote_port", "tp_size"}


def rid_of(headers: dict[str, str]) -> str:
    """The ``X-Request-Id`` a stub received (header names are case-blind)."""
    return next(v for k, v in headers.items() if k.lower() == "x-request-id")


def vllm_config(prefills: list[StubWorker], decodes: list[StubWorker], **kw: Any) -> Any:
    return router_config(prefills, decodes, pd_protocol="vllm", **kw)


async def test_pull_sends_the_prefill_one_token_then_the_decode_its_params(
        stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(vllm_config([p], [d]))
    body = {"model": "m", "prompt": "hello there", "stream": True, "max_tokens": 7,
            "min_tokens": 3, "stream_options": {"include_usage": True},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil.example"}}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")  # the decode's stream, relayed
    sent = p.bodies[0]
    # vLLM's proxy contract: the prefill computes one token, unstreamed, for a remote decode.
    assert sent["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert not {"min_tokens", "stream_options"} & set(sent)
    # The decode gets the client's own body and the prefill's params as they came.
    got = d.bodies[0]
    assert {k: got[k] for k in ("stream", "max_tokens", "min_tokens", "stream_options")} == {
        "stream": True, "max_tokens": 7, "min_tokens": 3, "stream_options": {"include_usage": True}}
    params = got["kv_transfer_params"]
    assert PULL_KEYS <= set(params) and params["remote_engine_id"] == "prefill0"
    assert params["remote_host"] == "10.0.0.7"  # the prefill's word, not the client's
    # One request id, fresh (not the client's), shared by both halves: vLLM pairs by it.
    rid = rid_of(p.headers[0])
    assert rid_of(d.headers[0]) == rid != resp.headers["x-request-id"]
    assert params["remote_request_id"].startswith(f"cmpl-{rid}-")
    assert await client.metric_lines("kvatlas_router_vllm_pd_requests_total") == [
        'kvatlas_router_vllm_pd_requests_total{mode="pull",params="given"} 1.0']


async def test_pull_chat_unstreamed_and_a_prefill_without_params(
        stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(vllm_config([p], [d]))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    resp = await client.post("/v1/chat/completions", json=chat)
    assert resp.status == 200 and (await resp.json())["worker"] == "decode0"
    assert p.bodies[0]["max_completion_tokens"] == 1
    assert d.bodies[0]["kv_transfer_params"]["remote_request_id"].startswith("chatcmpl-")
    # A prefill that answers no params (vLLM's, when it aborted): the decode is sent the
    # client's body alone and computes the prompt itself; counted, not failed.
    p.kv_params = False
    resp = await client.post("/v1/chat/completions", json=chat)
    assert resp.status == 200
    assert "kv_transfer_params" not in d.bodies[1]
    assert 'kvatlas_router_vllm_pd_requests_total{mode="pull",params="missing"} 1.0' in (
        await client.metric_lines("kvatlas_router_vllm_pd_requests_total"))


@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_a_failed_half_is_retried_on_another_pair_with_a_new_request_id(
        failing: str, stubs: Any, start_router: Any) -> None:
    prefills, decodes = await stubs("prefill", 2), await stubs("decode", 2)
    for w in prefills if failing == "prefill" else decodes:
        w.statuses = [503]
    client = await start_router(vllm_config(prefills, decodes))
    resp = await client.post("/v1/completions", json={"prompt": "retry me", "max_tokens": 2})
    assert resp.status == 200
    failed = prefills if failing == "prefill" else decodes
    # Each fails once: the second attempt avoided the first's worker, the third found it well.
    assert sorted(len(w.bodies) for w in failed) == [1, 2]
    ids = [rid_of(h) for w in prefills for h in w.headers]
    assert len(ids) == len(set(ids)) == 3  # each attempt its own id
    if failing == "prefill":
        assert sum(len(w.bodies) for w in decodes) == 1  # no decode for the failed prefill
    assert await client.metric_lines("kvatlas_router_upstream_errors_total") == [
        f'kvatlas_router_upstream_errors_total{{reason="503",role="{failing}"}} 2.0']


async def test_a_client_hanging_up_during_the_prefill_aborts_it_and_sends_no_decode(
        stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    p.hold = asyncio.Event()
    client = await start_router(vllm_config([p], [d]))
    task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "bye"}))
    await wait_until(lambda: len(p.bodies) == 1,
                     what="the prefill got the request")
    task.cancel()
    await asyncio.wait_for(p.wait_cancelled(1), 10)
    assert d.bodies == []
    m = await client.metric_lines("kvatlas_router_client_disconnects_total")
    assert m == ['kvatlas_router_client_disconnects_total{route="/v1/completions"} 1.0']
    assert await client.metric_lines("kvatlas_router_upstream_errors_total") == []


async def test_generate_and_batches_are_refused_when_only_vllm_pairs_serve(
        stubs: Any, start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(vllm_config([p], [d]))
    for path, body in (("/generate", {"text": "native"}),
                       ("/v1/completions", {"prompt": ["a", "b"]})):
        resp = await client.post(path, json=body)
        assert resp.status == 400, path
        error = (await resp.json())["error"]  # SGLang's shape on /generate, OpenAI's on /v1
        assert "vLLM's protocol" in (error if isinstance(error, str) else error["message"])
    assert p.bodies == [] and d.bodies == []


def test_static_push_is_refused_naming_what_it_needs() -> None:
    with pytest.raises(ValueError, match="vllm-push needs each prefill's NIXL engine id"):
        RouterConfig(prefill=[("http://127.0.0.1:1", None)], decode=["http://127.0.0.1:2"],
                     pd_protocol="vllm-push")
    with pytest.raises(ValueError, match="PD protocol must be sglang, vllm"):
        RouterConfig(pd_protocol="nixl")


PUSH = {"name": "vllm", "mode": "push", "engine_id": "p-engine-7", "host": "10.0.0.9",
        "port": 5611, "tp_size": 2}


async def test_push_names_the_prefill_in_advance_and_sends_both_at_once(
        stubs: Any, start_router: Any, register: Any, etcd_settings: Any,
        key_prefix: str) -> None:
    (p, p_anon), (d, d_pull) = await stubs("prefill", 2), await stubs("decode", 2)
    await register("p-push", {"role": "prefill", "url": p.url, "model": "m", "pd_protocol": PUSH,
                              "pp_size": 1})
    # A push prefill whose identity is unknown cannot be named to a decode: never chosen.
    await register("p-anon", {"role": "prefill", "url": p_anon.url, "model": "m",
                              "pd_protocol": {**PUSH, "engine_id": None}})
    await register("d-push", {"role": "decode", "url": d.url, "model": "m",
                              "pd_protocol": {"name": "vllm", "mode": "push"}})
    # A pull decode never pairs with a push prefill (the two modes refuse each other).
    await register("d-pull", {"role": "decode", "url": d_pull.url, "model": "m",
                              "pd_protocol": {"name": "vllm", "mode": "pull"}})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             health_interval=60, tokenizers={None: "byte"}))

    async def listed() -> bool:
        workers = await (await client.get("/workers")).json()
        return len(workers["prefill"]) == 2 and len(workers["decode"]) == 2
    await wait_until(listed,
                     what="the router lists the two prefills and decodes")
    workers = await (await client.get("/workers")).json()
    assert {w["instance_id"]: w["pd_protocol"] for w in workers["decode"]} == {
        "d-push": "vllm-push", "d-pull": "vllm-pull"}
    p.hold = asyncio.Event()  # the prefill answers only after the decode was sent its request
    for i in range(4):
        task = asyncio.create_task(client.post("/v1/completions", json={
            "prompt": f"push {i}", "max_tokens": 3}))
        await wait_until(lambda n=i + 1: len(d.bodies) == n,
                     what="the decode was sent its request while the prefill computed")
        p.hold.set()
        resp = await task
        assert resp.status == 200 and (await resp.json())["worker"] == "decode0"
        p.hold.clear()
    p.hold = None
    assert p_anon.bodies == [] and d_pull.bodies == []
    for sent, head, prefill_head in zip(d.bodies, d.headers, p.headers):
        rid = rid_of(head)
        assert rid_of(prefill_head) == rid
        assert sent["kv_transfer_params"] == {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": "p-engine-7", "remote_host": "10.0.0.9", "remote_port": 5611,
            "tp_size": 2, "remote_request_id": f"cmpl-{rid}", "pp_size": 1}
    assert p.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    route = json.loads((await client.post(
        "/v1/completions", json={"prompt": "explain"},
        headers={"X-Kvatlas-Explain": "1"})).headers["X-Kvatlas-Route"])
    assert route["pd_protocol"] == "vllm-push" and route["prefill"] == "p-push"


async def test_sglang_and_vllm_pairs_serve_side_by_side(stubs: Any, start_router: Any,
                                                       register: Any, etcd_settings: Any,
                                                       key_prefix: str) -> None:
    (ps, pv), (ds, dv) = await stubs("prefill", 2), await stubs("decode", 2)
    await register("p-sglang", {"role": "prefill", "url": ps.url, "model": "m"})
    await register("d-sglang", {"role": "decode", "url": ds.url, "model": "m"})
    await register("p-vllm", {"role": "prefill", "url": pv.url, "model": "m",
                              "pd_protocol": {"name": "vllm"}})
    await register("d-vllm", {"role": "decode", "url": dv.url, "model": "m",
                              "pd_protocol": {"name": "vllm"}})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             health_interval=60, tokenizers={None: "byte"},
                                             prefill_policy="round_robin"))

    async def listed() -> bool:
        workers = await (await client.get("/workers")).json()
        return len(workers["prefill"]) == 2 and len(workers["decode"]) == 2
    await wait_until(listed,
                     what="the router lists both pairs")
    for i in range(6):
        assert (await client.post("/generate", json={"text": f"native {i}"})).status == 200
        assert (await client.post("/v1/completions", json={"prompt": f"openai {i}"})).status \
            == 200
    # SGLang's /generate only ever goes to the bootstrap pair; each pair's halves agree.
    assert len(ds.bodies) == len(ps.bodies) >= 6 and len(dv.bodies) == len(pv.bodies) >= 1
    assert all("bootstrap_room" in b and "kv_transfer_params" not in b for b in ds.bodies)
    assert all("kv_transfer_params" in b and "bootstrap_room" not in b
               for b in dv.bodies + pv.bodies)


async def test_the_per_request_choice_spans_vllm_pairs_and_aggregated_workers(
        stubs: Any, start_router: Any, register: Any, etcd_settings: Any,
        key_prefix: str) -> None:
    (pv,), (dv,), (agg,) = await stubs("prefill"), await stubs("decode"), await stubs("decode")
    await register("p-vllm", {"role": "prefill", "url": pv.url, "model": "m",
                              "pd_protocol": {"name": "vllm"}})
    await register("d-vllm", {"role": "decode", "url": dv.url, "model": "m",
                              "pd_protocol": {"name": "vllm"}})
    await register("a0", {"role": "aggregated", "url": agg.url, "model": "m"})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             health_interval=60, tokenizers={None: "byte"},
                                             disagg_tokens=64))

    async def listed() -> bool:
        workers = await (await client.get("/workers")).json()
        return all(len(workers[r]) == 1 for r in ("prefill", "decode", "aggregated"))
    await wait_until(listed, what="the router lists the vLLM pair and the aggregated worker")
    short = await client.post("/v1/completions", json={"prompt": "short one"})
    long = await client.post("/v1/completions", json={"prompt": "long " * 40})
    assert short.status == long.status == 200
    # Under the threshold the aggregated worker serves it whole; over it, the vLLM pair.
    assert len(agg.bodies) == 1 and "kv_transfer_params" not in agg.bodies[0]
    assert len(pv.bodies) == len(dv.bodies) == 1
    assert dv.bodies[0]["kv_transfer_params"]["remote_engine_id"] == "prefill0"
    assert await client.metric_lines("kvatlas_router_disagg_decisions_total") == [
        'kvatlas_router_disagg_decisions_total{path="aggregated",reason="short_uncached"} 1.0',
        'kvatlas_router_disagg_decisions_total{path="pd",reason="long_uncached"} 1.0']
    # A /generate, which no vLLM pair carries, is the aggregated worker's whatever its length.
    resp = await client.post("/generate", json={"text": "long " * 40})
    assert resp.status == 200 and len(agg.bodies) == 2 and len(pv.bodies) == 1



@pytest.mark.parametrize("body", [
    b'{"prompt": "x"', b'{"prompt": ""}', b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": "x", "n": 0}', b'{"messages": "hi"}', b'[1, 2]'])
async def test_bad_bodies_never_reach_a_vllm_pair(body: bytes, stubs: Any,
                                                  start_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(vllm_config([p], [d]))
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    resp = await client.post(path, data=body, headers={"content-type": "application/json"})
    assert resp.status == 400, await resp.text()
    assert (await resp.json())["error"]["message"]
    assert p.bodies == [] and d.bodies == []
