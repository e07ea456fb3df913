"""/workers: anyone may list; adding and removing need the admin token."""
from __future__ import annotations

from typing import Any

TOKEN = "s3cret-admin-token"


async def test_admin_token_guards_changes(stubs: Any, make_router: Any) -> None:
    (p,), (d, d2) = await stubs("prefill"), await stubs("decode", 2)
    client = await make_router([p], [d], admin_token=TOKEN)
    listed = await (await client.get("/workers")).json()
    assert [w["url"] for w in listed["decode"]] == [d.url]
    new = {"url": d2.url, "role": "decode"}
    assert (await client.post("/workers", json=new)).status == 401
    bad = {"authorization": "Bearer wrong-token-xx"}
    assert (await client.post("/workers", json=new, headers=bad)).status == 401
    good = {"authorization": f"Bearer {TOKEN}"}
    resp = await client.post("/workers", json=new, headers=good)
    assert resp.status == 201 and (await resp.json())["source"] == "admin"
    listed = await (await client.get("/workers")).json()
    assert sorted(w["url"] for w in listed["decode"]) == sorted([d.url, d2.url])
    assert (await client.delete(f"/workers?url={d.url}")).status == 401
    resp = await client.delete(f"/workers?url={d.url}", headers=good)
    assert resp.status == 200
    for _ in range(3):
        assert (await (await client.post("/generate", json={"text": "x"})).json())["worker"] \
            == "decode1"
    assert (await client.delete(f"/workers?url={d.url}", headers=good)).status == 404
    resp = await client.post("/workers", json={"url": "ftp://x", "role": "decode"}, headers=good)
    assert resp.status == 400
    resp = await client.post("/workers", json={"url": d.url, "role": "router"}, headers=good)
    assert resp.status == 400


async def test_admin_disabled_without_token(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    resp = await client.post("/workers", json={"url": d.url, "role": "decode"},
                             headers={"authorization": "Bearer anything-at-all"})
    assert resp.status == 403 and "--admin-token" in (await resp.json())["error"]


async def test_admin_calls_on_a_discovered_worker_are_refused(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    """A worker an etcd record describes is discovery's: deleting it (by id or URL), adding
    a worker with its id or its URL, or pointing it elsewhere is a 409 naming the record, and it
    keeps serving at the record's URL."""
    from etcd_instances import wait_for

    from router.config import RouterConfig
    (p,), (d, other) = await stubs("prefill"), await stubs("decode", 2)
    await register("p0", {"role": "prefill", "url": p.url, "model": "tiny"})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             model="tiny", health_interval=60,
                                             admin_token=TOKEN))

    async def ready() -> bool:
        return (await client.get("/readiness")).status == 200

    await wait_for(ready)
    good = {"authorization": f"Bearer {TOKEN}"}
    record = f"/{key_prefix.strip('/')}/v1/instances/d0"
    refused = [client.delete(f"/workers?url={d.url}/", headers=good),
               client.delete("/workers?instance_id=d0", headers=good),
               client.post("/workers", json={"url": other.url, "role": "decode",
                                             "instance_id": "d0"}, headers=good),
               client.post("/workers", json={"url": d.url, "role": "decode"}, headers=good),
               client.post("/workers", json={"url": d.url, "role": "prefill"}, headers=good)]
    for call in refused:
        resp = await call
        assert resp.status == 409, resp.status
        answer = await resp.json()
        assert answer["instance_id"] == "d0" and answer["record"].endswith("instances/d0")
        assert "drain its engine or stop its sidecar" in answer["error"], answer
    assert record.endswith(answer["record"].split("/v1/", 1)[1])
    workers = await (await client.get("/workers")).json()
    assert [(w["instance_id"], w["url"]) for w in workers["decode"]] == [("d0", d.url)]
    assert not workers["shadowed"] and not workers["prefill"][1:]
    resp = await client.post("/generate", json={"text": "still served"})
    assert resp.status == 200 and (await resp.json())["worker"] == "decode0"
    assert not other.bodies
    # A worker of its own the admin may still add and remove.
    resp = await client.post("/workers", json={"url": other.url, "role": "decode"},
                             headers=good)
    assert resp.status == 201
    assert (await client.delete(f"/workers?url={other.url}", headers=good)).status == 200
