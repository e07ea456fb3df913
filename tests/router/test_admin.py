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
