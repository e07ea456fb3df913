"""A mixed fleet (a PD pair and an aggregated worker of one model): the router chooses per
request. A prompt whose uncached part is short is served aggregated, a long one disaggregated;
when the prefills are busy and the aggregated worker is not, aggregated; the choice, its reason
and both costs show in X-Kvatlas-Route, /debug/route and a metric; the threshold changes at run
time."""
from __future__ import annotations

import json
from typing import Any

from router_stubs import router_config
from waiting import wait_until

from router.config import RouterConfig

BS = 16
TOKEN = "secret-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def _body(n_tokens: int, start: int = 1) -> dict[str, Any]:
    return {"input_ids": [start + i % 200 for i in range(n_tokens)],
            "sampling_params": {"max_new_tokens": 4}}


async def _mixed(stubs: Any, start_router: Any, **kw: Any) -> tuple[Any, Any, Any, Any]:
    (prefill,), (decode,), (agg,) = (await stubs("prefill", 1), await stubs("decode", 1),
                                     await stubs("aggregated", 1))
    cfg = router_config([prefill], [decode], explain_routes=True, block_size=BS, **kw)
    cfg.worker_urls = [agg.url]
    cfg.__post_init__()
    router = await start_router(cfg)
    return router, prefill, decode, agg


async def test_short_uncached_prompts_stay_aggregated_long_ones_are_disaggregated(
        stubs: Any, start_router: Any) -> None:
    router, prefill, decode, agg = await _mixed(stubs, start_router, disagg_tokens=256,
                                                admin_token=TOKEN)
    async with router.post("/generate", json=_body(5 * BS)) as r:
        assert r.status == 200, await r.text()
        route = json.loads(r.headers["x-kvatlas-route"])
    why = route["disaggregation"]
    assert why["path"] == "aggregated" and why["reason"] == "short_uncached", why
    assert why["aggregated"]["uncached_tokens"] == 5 * BS and why["pd"]["uncached_tokens"] == 80
    assert len(agg.bodies) == 1 and not prefill.bodies and not decode.bodies
    assert "bootstrap_room" not in agg.bodies[0]

    async with router.post("/generate", json=_body(40 * BS, start=7)) as r:
        assert r.status == 200, await r.text()
        why = json.loads(r.headers["x-kvatlas-route"])["disaggregation"]
    assert why["path"] == "pd" and why["reason"] == "long_uncached", why
    assert len(prefill.bodies) == 1 and len(decode.bodies) == 1 and len(agg.bodies) == 1
    assert prefill.bodies[0]["bootstrap_room"] == decode.bodies[0]["bootstrap_room"]

    # The same long prompt again: the aggregated worker does not hold it (the PD prefill
    # does), so it stays disaggregated; a threshold raised at run time keeps it aggregated.
    async with router.put("/admin/thresholds", json={"disagg_tokens": 100_000},
                          headers=ADMIN) as r:
        assert r.status == 200 and (await r.json())["disagg_tokens"] == 100_000
    async with router.post("/debug/route", json=_body(40 * BS, start=7)) as r:
        shown = await r.json()
    assert shown["shape"] == "aggregated" and shown["disaggregation"]["reason"] == \
        "short_uncached", shown
    lines = await router.metric_lines("kvatlas_router_disagg_decisions_total")
    assert any('path="pd"' in line and 'reason="long_uncached"' in line for line in lines), lines


async def test_busy_prefills_send_long_prompts_to_an_idle_aggregated_worker(
        stubs: Any, start_router: Any) -> None:
    router, prefill, decode, agg = await _mixed(stubs, start_router, disagg_tokens=64,
                                                busy_queue=4, load_interval=0.05)
    prefill.metrics_text = "sglang:num_queue_reqs 9\nsglang:num_running_reqs 1\n"
    agg.metrics_text = "sglang:num_queue_reqs 0\nsglang:num_running_reqs 0\n"

    async def prefill_seen_busy() -> bool:
        async with router.get("/workers") as r:
            doc = await r.json()
        engine = doc["prefill"][0].get("engine")
        return bool(engine) and engine.get("queue") == 9
    await wait_until(prefill_seen_busy, what="the router read the prefill's queue of 9")
    async with router.post("/generate", json=_body(40 * BS)) as r:
        assert r.status == 200, await r.text()
        why = json.loads(r.headers["x-kvatlas-route"])["disaggregation"]
    assert why["path"] == "aggregated" and why["reason"] == "prefill_busy", why
    assert len(agg.bodies) == 1 and not prefill.bodies


async def test_bad_disagg_threshold_is_a_400_naming_it(stubs: Any, start_router: Any) -> None:
    router, *_ = await _mixed(stubs, start_router, admin_token=TOKEN)
    for bad in (-1, "many", 1.5, True):
        async with router.put("/admin/thresholds", json={"disagg_tokens": bad},
                              headers=ADMIN) as r:
            body = await r.json()
            assert r.status == 400, body
            assert "disagg_tokens" in json.dumps(body), body


async def test_a_decode_that_prefills_locally_serves_short_prompts_whole(
        stubs: Any, start_router: Any, etcd_settings: Any, key_prefix: str,
        register: Any) -> None:
    """No aggregated worker, but a decode whose record says ``local_prefill``: a short prompt
    goes to it alone, asked with ``X-Kvatlas-Prefill: local`` and no bootstrap fields; a long
    one goes to the PD pair; a decode without the field is never sent a whole request."""
    (p,), (d_local, d_plain) = await stubs("prefill", 1), await stubs("decode", 2)
    router = await start_router(RouterConfig(
        etcd=etcd_settings, etcd_prefix=key_prefix, model="tiny", health_interval=60,
        tokenizers={None: "byte"}, explain_routes=True, block_size=BS, disagg_tokens=256,
        decode_policy="round_robin"))
    await register("p0", {"role": "prefill", "url": p.url, "model": "tiny"})
    await register("d-local", {"role": "decode", "url": d_local.url, "model": "tiny",
                               "local_prefill": True})
    await register("d-plain", {"role": "decode", "url": d_plain.url, "model": "tiny"})

    async def all_listed() -> bool:
        async with router.get("/workers") as r:
            doc = await r.json()
        return len(doc["prefill"]) == 1 and len(doc["decode"]) == 2
    await wait_until(all_listed, what="the router lists p0, d-local and d-plain")

    for i in range(3):
        async with router.post("/generate", json=_body(3 * BS, start=1 + i)) as r:
            assert r.status == 200, await r.text()
            why = json.loads(r.headers["x-kvatlas-route"])
        assert why["worker"] == "d-local" and why["disaggregation"]["path"] == "aggregated"
    assert len(d_local.bodies) == 3 and not d_plain.bodies and not p.bodies
    assert all("bootstrap_room" not in b for b in d_local.bodies)
    assert all(_lower(h).get("x-kvatlas-prefill") == "local" for h in d_local.headers)

    async with router.post("/generate", json=_body(40 * BS, start=50)) as r:
        assert r.status == 200, await r.text()
        why = json.loads(r.headers["x-kvatlas-route"])["disaggregation"]
    assert why["path"] == "pd" and len(p.bodies) == 1
    sent = (d_local.headers + d_plain.headers)[-1]
    assert "x-kvatlas-prefill" not in _lower(sent), "a PD decode was asked to prefill locally"


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


async def test_several_samples_go_to_a_worker_that_serves_them_whole(
        stubs: Any, start_router: Any, make_router: Any) -> None:
    """n > 1: a PD pair runs one sample per room, so such a request goes to an aggregated
    worker whatever its length; with PD pairs only it is a 400 naming the field."""
    router, prefill, decode, agg = await _mixed(stubs, start_router, disagg_tokens=16)
    long = _body(40 * BS)
    long["sampling_params"]["n"] = 3
    async with router.post("/generate", json=long) as r:
        assert r.status == 200, await r.text()
    assert agg.bodies[-1]["sampling_params"]["n"] == 3 and not prefill.bodies
    async with router.post("/v1/completions", json={"prompt": [1] * 700, "n": 2,
                                                    "max_tokens": 2}) as r:
        assert r.status == 200, await r.text()
    assert agg.bodies[-1]["n"] == 2 and not prefill.bodies

    (p,), (d,) = await stubs("prefill", 1), await stubs("decode", 1)
    pd_only = await make_router([p], [d])
    async with pd_only.post("/v1/completions", json={"prompt": [1, 2], "n": 2}) as r:
        body = await r.json()
        assert r.status == 400, body
        assert body["error"]["param"] == "n" and "must be 1" in body["error"]["message"], body
    assert not p.bodies and not d.bodies
