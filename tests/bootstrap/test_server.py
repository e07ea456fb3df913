"""The bootstrap HTTP server in-process (no etcd): SGLang's wire behaviour and the stricter checks."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from bootstrap_helpers import TOPOLOGY_QUERY, rank_body, route_query
from waiting import wait_until

from bootstrap.config import BootstrapConfig
from bootstrap.server import create_app
from bootstrap.table import DECODE_NULL_FIELDS


@pytest.fixture
async def client(aiohttp_client: Any) -> TestClient:
    return await aiohttp_client(create_app(BootstrapConfig(instance_id="p0", model="m")))


async def _text(resp: Any) -> tuple[int, str]:
    return resp.status, await resp.text()


async def test_reference_scenario(client: TestClient) -> None:
    """2 tp x 2 pp: 503 until the last distinct rank, then the topology document; 404 and 400."""
    assert await _text(await client.get("/health")) == (200, "OK")
    assert await _text(await client.get("/route", params=TOPOLOGY_QUERY)) == (
        503, "Prefill server not fully registered yet (0 workers registered).")
    cells = [(tp, pp) for tp in range(2) for pp in range(2)]
    for i, (tp, pp) in enumerate(cells):
        resp = await client.put("/route", json=rank_body(tp=tp, pp=pp, tp_size=2, pp_size=2))
        assert await _text(resp) == (200, "OK")
        if i < 3:
            # Even a registered cell is refused until the table is complete.
            assert await _text(await client.get("/route", params=route_query(0, 0, 0, 0))) == (
                503, f"Prefill server not fully registered yet ({i + 1} workers registered).")
            assert await _text(await client.get("/ready")) == (503, f"{i + 1} of 4 ranks registered")
    assert await _text(await client.get("/ready")) == (200, "4 of 4 ranks registered")

    resp = await client.get("/route", params=TOPOLOGY_QUERY)
    assert resp.status == 200 and resp.content_type == "application/json"
    doc = json.loads(await resp.text())
    assert list(doc) == ["attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
                         "kv_cache_dtype", "follow_bootstrap_room", "enable_dsa_cache_layer_split",
                         "decode_allocation_policy", "enable_kv_cache_sharding",
                         "prefill_http_port", *DECODE_NULL_FIELDS]
    assert doc["attn_tp_size"] == 2 and doc["pp_size"] == 2 and doc["dp_size"] == 1
    assert doc["page_size"] == 16 and doc["kv_cache_dtype"] == "auto"
    assert doc["prefill_http_port"] == 30000 and doc["follow_bootstrap_room"] is True

    resp = await client.get("/route", params=route_query(0, 0, 1, 1))
    assert resp.status == 200
    want_port = rank_body(tp=1, pp=1, tp_size=2, pp_size=2)["rank_port"]
    assert await resp.json() == {"rank_ip": "10.0.0.1", "rank_port": want_port}
    assert await _text(await client.get("/route", params=route_query(0, 0, 2, 0))) == (
        404, "Bootstrap info not found for dp_rank=0 cp_rank=0 tp_rank=2 pp_rank=0")
    # A mix including -1 is looked up, and gives 404.
    assert (await client.get("/route", params=route_query(-1, 0, 0, 0))).status == 404
    missing = dict(route_query(0, 0, 0, 0))
    del missing["target_pp_rank"]
    assert await _text(await client.get("/route", params=missing)) == (
        400, "Missing inputs for bootstrap server.")
    empty = {**route_query(0, 0, 0, 0), "target_tp_rank": ""}
    assert await _text(await client.get("/route", params=empty)) == (
        400, "Missing inputs for bootstrap server.")
    # Unknown extra query parameters are ignored.
    resp = await client.get("/route", params={**route_query(0, 0, 0, 0), "extra": "x"})
    assert resp.status == 200


async def test_well_formed_get_before_readiness_is_503_for_any_cell(client: TestClient) -> None:
    await client.put("/route", json=rank_body(tp=0, tp_size=2))
    for q in (route_query(0, 0, 0, 0), route_query(0, 0, 1, 0), route_query(5, 5, 5, 5),
              route_query(-1, 0, 0, 0)):
        assert (await client.get("/route", params=q)).status == 503


async def test_dp_rank_register_and_query(client: TestClient) -> None:
    for room, dp in [(11, 0), (12, 1), (11, 1)]:
        assert await _text(await client.post("/register_dp_rank",
                                              json={"bootstrap_room": room, "dp_rank": dp})) == (200, "OK")
    resp = await client.post("/query_dp_ranks", json={"bootstrap_rooms": [11, 12, 13, "12"]})
    assert resp.status == 200
    assert await resp.json() == {"11": 1, "12": 1}
    big = 2**63 - 1
    await client.post("/register_dp_rank", json={"bootstrap_room": big, "dp_rank": 0, "x": 1})
    assert await (await client.post("/query_dp_ranks", json={"bootstrap_rooms": [big]})).json() == {
        str(big): 0}


def _put(body: Any) -> tuple[str, str, Any]:
    return ("PUT", "/route", body)


BAD_INPUTS = [
    ("PUT", "/route", b"{not json"),
    ("PUT", "/route", b""),
    _put(["a", "list"]),
    _put({k: v for k, v in rank_body().items() if k != "rank_port"}),
    _put(rank_body(attn_tp_size="1")),
    _put(rank_body(dp=-1)),
    _put(rank_body(tp=2, tp_size=2)),
    _put(rank_body(tp_size=0)),
    _put(rank_body(port=0)),
    _put(rank_body(port=65536)),
    _put(rank_body(ip="10.0.0.256")),
    _put(rank_body(ip="bad host!")),
    _put(rank_body(ip="[evil\n]")),  # a newline would reach decodes and the logs
    _put(rank_body(ip="[10.0.0.1]")),  # brackets only wrap IPv6
    ("PUT", "/route", json.dumps(rank_body()).replace('"auto"', "NaN").encode()),
    # JSON is UTF-8 (RFC 8259): the standard parser's guess at UTF-16/32 bytes is no licence
    ("PUT", "/route", json.dumps(rank_body()).encode("utf-16")),
    ("PUT", "/route", json.dumps(rank_body()).encode("utf-32-be")),
    ("POST", "/register_dp_rank", b"nope"),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5}),
    ("POST", "/register_dp_rank", {"bootstrap_room": "x", "dp_rank": 0}),
    ("POST", "/register_dp_rank", {"bootstrap_room": -1, "dp_rank": 0}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 2**64, "dp_rank": 0}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": -1}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 1.5}),
    ("POST", "/query_dp_ranks", {"rooms": [1]}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": 5}),
    ("POST", "/query_dp_ranks", {"bootstrap_rooms": [1, None]}),
    ("POST", "/query_dp_ranks", b"[1,2"),
]


@pytest.mark.parametrize("method,path,body", BAD_INPUTS)
async def test_bad_input_is_400_json_naming_the_problem(client: TestClient, method: str,
                                                        path: str, body: Any) -> None:
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    resp = await client.request(method, path, **kwargs)
    assert resp.status == 400
    err = await resp.json()
    assert isinstance(err["error"], str) and err["error"]
    # The table did not take anything from a refused registration.
    table = await (await client.get("/table")).json()
    assert table["registered_ranks"] == 0 and table["topology"] is None


@pytest.mark.parametrize("path,body", [
    ("/register_dp_rank", {"bootstrap_room": 2**63, "dp_rank": 0}),
    ("/query_dp_ranks", {"bootstrap_rooms": [5, 2**63]}),
])
async def test_room_above_sglangs_range_is_400_naming_it(client: TestClient, path: str,
                                                         body: dict[str, Any]) -> None:
    # SGLang takes rooms in [0, 2^63-1] (index.rooms.ROOMS); a u64 above it is refused, not kept.
    resp = await client.post(path, json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert "[0, 2^63-1]" in error and str(2**63) in error
    resp = await client.post("/register_dp_rank", json={"bootstrap_room": 0, "dp_rank": 0})
    assert resp.status == 200  # the range's low end is SGLang's too


@pytest.mark.parametrize("value", ["abc", "1.5", "0x1", "--1", "1e3"])
async def test_non_integer_query_parameter_is_400_json(client: TestClient, value: str) -> None:
    await client.put("/route", json=rank_body())
    resp = await client.get("/route", params={**route_query(0, 0, 0, 0), "target_tp_rank": value})
    assert resp.status == 400
    assert "target_tp_rank" in (await resp.json())["error"]


@pytest.mark.parametrize("path", ["/route", "/register_dp_rank", "/query_dp_ranks"])
async def test_body_over_64k_is_413_json(client: TestClient, path: str) -> None:
    method = "PUT" if path == "/route" else "POST"
    payload = json.dumps({**rank_body(), "pad": "x" * (64 * 1024)}).encode()
    resp = await client.request(method, path, data=payload)
    assert resp.status == 413
    assert "65536" in (await resp.json())["error"]

    async def chunks():  # no Content-Length: the limit must hold while streaming, too
        for _ in range(80):
            yield b" " * 1024

    resp = await client.request(method, path, data=chunks())
    assert resp.status == 413


async def test_conflicting_put_is_409_and_not_counted(client: TestClient) -> None:
    await client.put("/route", json=rank_body(tp=0, tp_size=2))
    resp = await client.put("/route", json=rank_body(tp=1, tp_size=2, kv_cache_dtype="fp8_e4m3"))
    assert resp.status == 409
    err = await resp.json()
    assert err["field"] == "kv_cache_dtype" and "kv_cache_dtype" in err["error"]
    assert await _text(await client.get("/ready")) == (503, "1 of 2 ranks registered")


async def test_auth_token_guards_put_and_post_only(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(
        BootstrapConfig(instance_id="p0", model="m", auth_token="s3cret")))
    good = {"Authorization": "Bearer s3cret"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        resp = await client.put("/route", json=rank_body(), headers=headers)
        assert resp.status == 401 and "Bearer" in (await resp.json())["error"]
        resp = await client.post("/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0},
                                 headers=headers)
        assert resp.status == 401
        resp = await client.post("/query_dp_ranks", json={"bootstrap_rooms": [1]}, headers=headers)
        assert resp.status == 401
    # Header bytes that are not UTF-8 are a wrong token, not a server error.
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /register_dp_rank HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 401")
    writer.close()
    assert (await client.get("/ready")).status == 503  # nothing got in
    assert (await client.put("/route", json=rank_body(), headers=good)).status == 200
    assert (await client.get("/route", params=TOPOLOGY_QUERY)).status == 200
    assert (await client.get("/health")).status == 200
    assert (await client.get("/table")).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert "kvatlas_bootstrap_unauthorized_total 10.0" in metrics


async def test_table_and_metrics(client: TestClient) -> None:
    await client.put("/route", json=rank_body(tp=0, tp_size=2, port=7000))
    await client.put("/route", json=rank_body(tp=0, tp_size=2, port=7001))  # replaced
    await client.put("/route", json=rank_body(tp=1, tp_size=2, page_size=8))  # 409
    await client.put("/route", data=b"{")  # invalid
    await client.get("/route", params=TOPOLOGY_QUERY)  # 503
    await client.put("/route", json=rank_body(tp=1, tp_size=2, port=7002))
    await client.get("/route", params=TOPOLOGY_QUERY)  # 200
    await client.get("/route", params=route_query(0, 0, 9, 0))  # 404
    table = await (await client.get("/table")).json()
    assert table["ready"] is True and table["expected_ranks"] == 2
    assert [(r["tp"], r["rank_port"]) for r in table["ranks"]] == [(0, 7001), (1, 7002)]
    assert table["mirror"]["state"] == "disabled"
    resp = await client.get("/metrics")
    assert resp.status == 200 and resp.content_type.startswith("text/plain")
    text = await resp.text()
    for line in ('kvatlas_bootstrap_registrations_total{outcome="new"} 2.0',
                 'kvatlas_bootstrap_registrations_total{outcome="replaced"} 1.0',
                 'kvatlas_bootstrap_registrations_total{outcome="conflict"} 1.0',
                 'kvatlas_bootstrap_registrations_total{outcome="invalid"} 1.0',
                 'kvatlas_bootstrap_route_queries_total{kind="topology",status="503"} 1.0',
                 'kvatlas_bootstrap_route_queries_total{kind="topology",status="200"} 1.0',
                 'kvatlas_bootstrap_route_queries_total{kind="rank",status="404"} 1.0',
                 "kvatlas_bootstrap_ranks_registered 2.0", "kvatlas_bootstrap_ready 1.0",
                 'kvatlas_bootstrap_mirror_state{state="disabled"} 1.0',
                 "kvatlas_bootstrap_mirror_lag_seconds 0.0"):
        assert line in text, line


async def test_room_flood_is_bounded_and_swept(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(BootstrapConfig(
        instance_id="p0", model="m", dp_room_max_entries=50, dp_room_ttl=0.3,
        dp_room_sweep_interval=0.1)))
    for room in range(120):
        await client.post("/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 0})
    got = await (await client.post("/query_dp_ranks",
                                   json={"bootstrap_rooms": list(range(120))})).json()
    assert sorted(int(k) for k in got) == list(range(70, 120))
    metrics = await (await client.get("/metrics")).text()
    assert "kvatlas_bootstrap_dp_rooms 50.0" in metrics
    assert "kvatlas_bootstrap_dp_rooms_evicted 70.0" in metrics

    async def swept() -> bool:  # TTL 0.3 s, swept every 0.1 s
        return "kvatlas_bootstrap_dp_rooms 0.0" in await (await client.get("/metrics")).text()
    await wait_until(swept, what="the sweep empties the room table")
