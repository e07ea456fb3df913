"""Pairing: a static (or admin) worker and an etcd record of the same URL are one worker,
whichever came first; the record's id (the block index's) serves, the static one comes back
when the record leaves or moves. Pools directly, then end to end with real etcd and stubs."""
from __future__ import annotations

from typing import Any

import pytest
from etcd_block_index import EtcdBlockIndex
from etcd_instances import wait_for
from router_stubs import encode_text

from index.hashing import block_hashes
from router.config import RouterConfig
from router.limits import stated_limits
from router.metrics import RouterMetrics
from router.workers import DECODE, ETCD, PREFILL, WorkerPools, normalize_url

TOKEN = "s3cret-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SYSTEM = "You are kvatlas, a careful assistant. Answer briefly and cite sources. " * 4


@pytest.mark.parametrize(("a", "b"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/"),
    ("http://LocalHost:8000", "http://localhost:8000"),
    ("HTTP://example.com", "http://example.com:80"),
    ("https://example.com/", "https://EXAMPLE.com:443"),
    ("http://[::1]:9000", "http://[::1]:9000/"),
])
def test_normalized_urls_are_one_server(a: str, b: str) -> None:
    assert normalize_url(a) == normalize_url(b)


@pytest.mark.parametrize(("a", "b"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8001"),
    ("http://example.com", "https://example.com"),
    ("http://a.example:80", "http://b.example:80"),
])
def test_different_servers_stay_apart(a: str, b: str) -> None:
    assert normalize_url(a) != normalize_url(b)


def _states(pools: WorkerPools, role: str) -> dict[str, str | None]:
    return {w.instance_id: w.shadowed_by for w in pools.pool(role)}


@pytest.mark.parametrize("static_first", [True, False], ids=["static-then-record",
                                                              "record-then-static"])
def test_pairing_is_symmetric_and_undone_when_the_record_goes(static_first: bool) -> None:
    pools = WorkerPools(RouterConfig())
    heard: list[tuple[str, str, str | None]] = []
    pools.listeners.append(lambda ev, w: heard.append((ev, w.instance_id, w.shadowed_by)))

    def static() -> None:
        pools.add(PREFILL, "http://LocalHost:8000/", bootstrap_port=9000)

    def record() -> None:
        pools.add(PREFILL, "http://localhost:8000", instance_id="p-real", source=ETCD,
                  model="tiny", record={"max_prompt_tokens": 100})

    (static if static_first else record)()
    (record if static_first else static)()
    assert _states(pools, PREFILL) == {"static-localhost-8000": "p-real", "p-real": None}
    # Listeners hear of a worker already paired.
    assert ("join", "static-localhost-8000", None if static_first else "p-real") in heard
    # Counted once: only the record's worker is selectable and counts.
    assert [w.instance_id for w in pools.pool(PREFILL) if w.available] == ["p-real"]
    assert [w.instance_id for w in pools.counted()] == ["p-real"]
    assert pools.unavailable_reason(PREFILL).startswith("all 1 prefill")

    # The record moves to another server: the static worker serves its URL again.
    pools.add(PREFILL, "http://127.0.0.1:8001", instance_id="p-real", source=ETCD)
    assert _states(pools, PREFILL) == {"static-localhost-8000": None, "p-real": None}
    # ... and back: shadowed again.
    pools.add(PREFILL, "http://localhost:8000", instance_id="p-real", source=ETCD)
    assert _states(pools, PREFILL)["static-localhost-8000"] == "p-real"
    pools.remove(PREFILL, "p-real")
    assert _states(pools, PREFILL) == {"static-localhost-8000": None}
    assert pools.pool(PREFILL)[0].available


def test_only_the_same_role_pairs_and_a_second_record_takes_over() -> None:
    pools = WorkerPools(RouterConfig())
    pools.add(PREFILL, "http://127.0.0.1:8000")
    pools.add(DECODE, "http://127.0.0.1:8000", instance_id="d-real", source=ETCD)
    assert _states(pools, PREFILL) == {"static-127.0.0.1-8000": None}
    pools.add(PREFILL, "http://127.0.0.1:8000", instance_id="a", source=ETCD)
    pools.add(PREFILL, "http://127.0.0.1:8000/", instance_id="b", source=ETCD)
    assert _states(pools, PREFILL)["static-127.0.0.1-8000"] == "a"
    pools.remove(PREFILL, "a")
    # Another record still names the URL: the static worker stays shadowed, by that one.
    assert _states(pools, PREFILL)["static-127.0.0.1-8000"] == "b"
    # Removing by URL matches normalized URLs too.
    assert {w.instance_id for w in pools.remove_url("http://127.0.0.1:8000/")} == {
        "static-127.0.0.1-8000", "b", "d-real"}
    assert pools.remove_url("not a url") == []


def test_a_shadowed_worker_counts_nowhere() -> None:
    pools = WorkerPools(RouterConfig())
    # The static worker would state a smaller limit (say, a stale /server_info answer).
    static = pools.add(PREFILL, "http://127.0.0.1:8000")
    pools.learned(static, stated_limits({"max_prompt_tokens": 10}, static.instance_id))
    assert pools.limits.prompt(None).value == 10  # type: ignore[union-attr]
    pools.add(PREFILL, "http://127.0.0.1:8000", instance_id="p-real", source=ETCD,
              record={"max_prompt_tokens": 1000})
    assert pools.limits.prompt(None).value == 1000  # type: ignore[union-attr]
    metrics = RouterMetrics()
    metrics.set_breakers(pools.all())
    text = metrics.render().decode()
    assert 'kvatlas_router_workers{available="true",role="prefill"} 1.0' in text
    assert 'available="false",role="prefill"' not in text
    assert "static-127.0.0.1-8000" not in text
    pools.remove(PREFILL, "p-real")
    assert pools.limits.prompt(None).value == 10  # type: ignore[union-attr]


async def _router(start_router: Any, etcd_settings: Any, key_prefix: str, **kw: Any) -> Any:
    return await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                           health_interval=60, tokenizers={None: "byte"},
                                           admin_token=TOKEN, **kw))


async def _workers(client: Any) -> dict[str, Any]:
    return await (await client.get("/workers")).json()


async def test_static_flags_take_the_records_index_entries(
        start_router: Any, etcd: Any, layout: Any, etcd_settings: Any, key_prefix: str,
        stubs: Any, register: Any) -> None:
    """Started with static flags only, the router pairs them with the records of their URLs:
    the prompt's blocks, indexed under the record's id, steer the route, and the answer comes
    from that very server."""
    prefills, (d,) = await stubs("prefill", 2), await stubs("decode")
    await register("p-real", {"role": "prefill", "url": prefills[1].url + "/", "model": "tiny",
                              "block_size": 16})
    await register("d-real", {"role": "decode", "url": d.url + "/", "model": "tiny"})
    prompt = SYSTEM + "Where does the KV live?"
    index = EtcdBlockIndex(etcd, layout, "tiny")
    await index.start()
    try:
        await index.add("p-real", None, block_hashes(encode_text(prompt), 16)[:10])
        await index.settle()
        client = await _router(start_router, etcd_settings, key_prefix,
                               prefill=[(p.url, None) for p in prefills], decode=[d.url])

        async def routed() -> Any:
            resp = await client.post("/debug/route", json={"text": prompt})
            body = await resp.json()
            return body if resp.status == 200 and body["index_blocks"] > 0 else None

        await wait_for(routed, timeout=10)
        body = await routed()
        assert body["prefill"]["instance_id"] == "p-real", body
        assert body["index_blocks"] == 10
        assert body["decode"]["instance_id"] == "d-real"
        ids = {c["instance_id"] for c in body["candidates"]}
        assert ids == {"p-real", "static-127.0.0.1-" + str(prefills[0].port)}
        workers = await _workers(client)
        assert {w["instance_id"] for w in workers["shadowed"]} == {
            f"static-127.0.0.1-{d.port}", f"static-127.0.0.1-{prefills[1].port}"}
        ready = await (await client.get("/readiness")).json()
        assert ready["prefill"]["total"] == 2 and ready["decode"]["total"] == 1
        assert (await client.post("/generate", json={"text": prompt})).status == 200
        assert len(prefills[1].bodies) == 1 and not prefills[0].bodies
    finally:
        await index.close()


async def test_record_then_admin_worker_then_record_leaves(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    inst = await register("p-real", {"role": "prefill", "url": p.url, "model": "tiny"})
    await register("d-real", {"role": "decode", "url": d.url, "model": "tiny"})
    # A static flag of the same server (the admin API refuses a twin of a discovered worker).
    client = await _router(start_router, etcd_settings, key_prefix, prefill=[(p.url + "/", None)])

    async def joined() -> bool:
        return [w["instance_id"] for w in (await _workers(client))["prefill"]] == ["p-real"]

    await wait_for(joined)
    resp = await client.post("/workers", json={"url": p.url + "/", "role": "prefill"},
                             headers=AUTH)
    assert resp.status == 409 and "p-real" in (await resp.json())["error"]
    workers = await _workers(client)
    assert [w["instance_id"] for w in workers["prefill"]] == ["p-real"]
    assert [w["shadowed_by"] for w in workers["shadowed"]] == ["p-real"]
    body = await (await client.post("/debug/route", json={"text": "x" * 64})).json()
    assert [c["instance_id"] for c in body["candidates"]] == ["p-real"]
    assert await client.metric_lines(
        'kvatlas_router_workers{available="true",role="prefill"} 1.0')

    await inst.stop()  # the record leaves: the admin's worker serves again

    async def static_back() -> bool:
        body = await (await client.post("/debug/route", json={"text": "x" * 64})).json()
        return body.get("prefill", {}).get("instance_id", "").startswith("static-")

    await wait_for(static_back)
    assert not (await _workers(client))["shadowed"]
    assert (await client.post("/generate", json={"text": "hello"})).status == 200
    assert len(p.bodies) == 1
