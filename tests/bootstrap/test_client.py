"""The decode-side bootstrap client against real HTTP servers on loopback.

``SGLangLikeServer`` is a small aiohttp app written here from the wire format in
``reference/sglang-bootstrap.md`` (plain-text errors, 503 until ready, string room keys), so the
client is checked against SGLang's behaviour independently of kvatlas's own server; the last test
runs it against ``bootstrap.server.create_app``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from waiting import wait_until

from bootstrap.client import BootstrapClient, BootstrapClientConfig, format_addr, parse_addr
from bootstrap.errors import (
    BadResponse,
    BootstrapAuthError,
    BootstrapNotReady,
    BootstrapUnreachable,
    TopologyMismatch,
    UnknownRank,
)
from bootstrap.mapping import DecodeParallel, PrefillServerInfo, RankAddress
from kvatlas.etcd_proc import free_port

FAST = BootstrapClientConfig(retry_interval_s=0.02, tries=5, timeout_s=2.0)

TOPOLOGY = PrefillServerInfo(attn_tp_size=2, attn_cp_size=1, dp_size=2, pp_size=1, page_size=16,
                             kv_cache_dtype="auto", follow_bootstrap_room=False, prefill_http_port=30000)


class SGLangLikeServer:
    """Answers like SGLang's CommonKVBootstrapServer, with knobs to misbehave.

    ``not_ready_for``: how many topology GETs get 503 before it turns ready. ``mode`` replaces the
    topology answer: "bad_json", "bad_doc", "slow" (sleeps past the client timeout), "boom" (500).
    """

    def __init__(self, host: str = "127.0.0.1", *, not_ready_for: int = 0, mode: str = "",
                 token: str | None = None, topology: PrefillServerInfo = TOPOLOGY) -> None:
        self.host = host
        self.topology = topology
        self.port = 0
        self.not_ready_for = not_ready_for
        self.mode = mode
        self.token = token
        self.table = {(dp, 0, tp, 0): (f"10.0.{dp}.{tp}", 17000 + 10 * dp + tp)
                      for dp in range(2) for tp in range(2)}
        self.rooms: dict[int, int] = {}
        self.calls: collections.Counter[str] = collections.Counter()
        self.peers: set[tuple[Any, ...]] = set()
        self.auth_seen: list[str | None] = []
        self.ready = not_ready_for == 0
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/route", self.get_route)
        app.router.add_post("/register_dp_rank", self.register_dp_rank)
        app.router.add_post("/query_dp_ranks", self.query_dp_ranks)
        app.router.add_get("/health", self.health)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)  # the kernel picks a free port: no race
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _seen(self, request: web.Request, name: str) -> None:
        self.calls[name] += 1
        self.peers.add(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]

    async def get_route(self, request: web.Request) -> web.StreamResponse:
        self._seen(request, "route")
        q = request.query
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if any(not q.get(n) for n in names):
            return web.Response(status=400, text="Missing inputs for bootstrap server.")
        dp, cp, tp, pp = (int(q[n]) for n in names)
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            self.calls["topology"] += 1
            if self.calls["topology"] <= self.not_ready_for:
                return web.Response(status=503, text="Prefill server not fully registered yet "
                                                          "(3 workers registered).")
            self.ready = True
            if self.mode == "bad_json":
                return web.Response(text="<html>hello</html>", content_type="text/html")
            if self.mode == "bad_doc":
                return web.json_response({"attn_tp_size": 2, "dp_size": 1})
            if self.mode == "slow":
                await asyncio.sleep(1.0)  # a slow server is the thing tested, not a wait
            if self.mode == "boom":
                return web.Response(status=500, text="Internal Server Error")
            return web.json_response(self.topology.to_json())
        if not self.ready:
            return web.Response(status=503, text="Prefill server not fully registered yet "
                                                          "(3 workers registered).")
        if (dp, cp, tp, pp) not in self.table:
            return web.Response(status=404, text=(
                f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"))
        ip, port = self.table[(dp, cp, tp, pp)]
        return web.json_response({"rank_ip": ip, "rank_port": port})

    def _authorized(self, request: web.Request) -> bool:
        self.auth_seen.append(request.headers.get("Authorization"))
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    async def register_dp_rank(self, request: web.Request) -> web.Response:
        self._seen(request, "register_dp_rank")
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        body = await request.json()
        self.rooms[body["bootstrap_room"]] = body["dp_rank"]
        return web.Response(text="OK")

    async def query_dp_ranks(self, request: web.Request) -> web.Response:
        self._seen(request, "query_dp_ranks")
        if not self._authorized(request):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        body = await request.json()
        return web.json_response({str(r): self.rooms[r] for r in body["bootstrap_rooms"] if r in self.rooms})

    async def health(self, request: web.Request) -> web.Response:
        self._seen(request, "health")
        return web.Response(text="OK")


@pytest.fixture
async def make_server() -> AsyncIterator[Any]:
    servers: list[SGLangLikeServer] = []

    async def make(**kw: Any) -> SGLangLikeServer:
        server = SGLangLikeServer(**kw)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


async def test_retries_until_ready_over_one_connection(make_server: Any) -> None:
    server = await make_server(not_ready_for=3)
    async with BootstrapClient(FAST) as client:
        info = await client.get_topology("127.0.0.1", server.port)
    assert info == TOPOLOGY
    assert server.calls["topology"] == 4
    assert len(server.peers) == 1, f"expected one kept-alive connection, saw {server.peers}"


async def test_gives_up_after_n_tries_with_the_servers_reason(make_server: Any) -> None:
    server = await make_server(not_ready_for=1000)
    async with BootstrapClient(FAST) as client:
        with pytest.raises(BootstrapNotReady) as err:
            await client.get_topology("127.0.0.1", server.port)
    assert server.calls["topology"] == FAST.tries
    assert err.value.tries == FAST.tries and err.value.last_status == 503
    assert err.value.addr == f"127.0.0.1:{server.port}"
    message = str(err.value)
    assert "not ready after 5 tries" in message
    assert "3 workers registered" in message and "PUT /route" in message


async def test_unreachable_after_n_tries() -> None:
    port = free_port()  # nothing listens there
    config = BootstrapClientConfig(retry_interval_s=0.01, tries=3, timeout_s=1.0)
    async with BootstrapClient(config) as client:
        with pytest.raises(BootstrapUnreachable) as err:
            await client.get_topology("127.0.0.1", port)
        assert not await client.health("127.0.0.1", port)
    assert "unreachable after 3 tries" in str(err.value)
    assert f"127.0.0.1:{port}" in str(err.value) and "bootstrap host and port" in str(err.value)


async def test_per_call_timeout_counts_as_a_failed_try(make_server: Any) -> None:
    server = await make_server(mode="slow")
    config = BootstrapClientConfig(retry_interval_s=0.01, tries=2, timeout_s=0.3)
    async with BootstrapClient(config) as client:
        with pytest.raises(BootstrapUnreachable, match="no answer within 0.3 s"):
            await client.get_topology("127.0.0.1", server.port)
    assert server.calls["topology"] == 2


@pytest.mark.parametrize(("mode", "needle"), [("bad_json", "not JSON"),
                                              ("bad_doc", "lacks attn_cp_size, pp_size")])
async def test_bad_topology_answer_fails_at_once(make_server: Any, mode: str, needle: str) -> None:
    server = await make_server(mode=mode)
    async with BootstrapClient(FAST) as client:
        with pytest.raises(BadResponse, match=needle) as err:
            await client.get_topology("127.0.0.1", server.port)
    assert err.value.status == 200
    assert server.calls["topology"] == 1, "an answer retrying cannot fix must not be retried"


async def test_server_errors_are_retried_then_reported(make_server: Any) -> None:
    server = await make_server(mode="boom")
    async with BootstrapClient(FAST) as client:
        with pytest.raises(BadResponse, match="answered 500") as err:
            await client.get_topology("127.0.0.1", server.port)
    assert err.value.status == 500 and server.calls["topology"] == FAST.tries


async def test_topology_is_cached_per_address_and_shared_by_concurrent_callers(make_server: Any) -> None:
    first = await make_server(not_ready_for=2)
    second = await make_server()
    async with BootstrapClient(FAST) as client:
        results = await asyncio.gather(*(client.get_topology("127.0.0.1", first.port) for _ in range(20)))
        assert all(r == TOPOLOGY for r in results)
        assert first.calls["topology"] == 3, "20 waiters must share one retry loop"
        await client.get_topology("127.0.0.1", first.port)
        assert first.calls["topology"] == 3
        assert client.cached_topology("127.0.0.1", first.port) == TOPOLOGY
        assert client.cached_topology("127.0.0.1", second.port) is None
        await client.get_topology("127.0.0.1", second.port)
        assert second.calls["topology"] == 1
        client.forget("127.0.0.1", first.port)
        await client.get_topology("127.0.0.1", first.port)
        assert first.calls["topology"] == 4
        await client.get_topology("127.0.0.1", first.port, refresh=True)
        assert first.calls["topology"] == 5


async def test_a_cancelled_waiter_does_not_cancel_the_shared_fetch(make_server: Any) -> None:
    server = await make_server(not_ready_for=3)
    async with BootstrapClient(FAST) as client:
        impatient = asyncio.ensure_future(client.get_topology("127.0.0.1", server.port))
        patient = asyncio.ensure_future(client.get_topology("127.0.0.1", server.port))
        await asyncio.sleep(0.01)
        impatient.cancel()
        assert await patient == TOPOLOGY
        assert impatient.cancelled()


async def test_rank_addresses_404_and_cache(make_server: Any) -> None:
    server = await make_server()
    async with BootstrapClient(FAST) as client:
        addr = await client.get_rank_address("127.0.0.1", server.port, 1, 0, 1, 0)
        assert addr == RankAddress("10.0.1.1", 17011)
        await client.get_rank_address("127.0.0.1", server.port, 1, 0, 1, 0)
        assert server.calls["route"] == 1, "a known cell is served from the cache"
        await client.get_rank_address("127.0.0.1", server.port, 1, 0, 1, 0, use_cache=False)
        assert server.calls["route"] == 2
        with pytest.raises(UnknownRank) as err:
            await client.get_rank_address("127.0.0.1", server.port, 0, 0, 2, 0)
        assert err.value.cell == (0, 0, 2, 0)
        assert "dp_rank=0 cp_rank=0 tp_rank=2 pp_rank=0" in str(err.value)
        assert "parallel sizes" in str(err.value)
        with pytest.raises(ValueError, match="tp rank"):
            await client.get_rank_address("127.0.0.1", server.port, 0, 0, -1, 0)


async def test_rank_address_before_ready_is_not_ready(make_server: Any) -> None:
    server = await make_server(not_ready_for=1000)
    async with BootstrapClient(FAST) as client:
        with pytest.raises(BootstrapNotReady, match="get_topology"):
            await client.get_rank_address("127.0.0.1", server.port, 0, 0, 0, 0)


async def test_mapping_end_to_end_and_dp_rooms(make_server: Any) -> None:
    """A decode with tp 1 reads both prefill tp ranks of the dp that the server names for its room."""
    server = await make_server()
    async with BootstrapClient(FAST) as client:
        info, mapping = await client.get_mapping("127.0.0.1", server.port, DecodeParallel(1, 0),
                                                 page_size=16, kv_cache_dtype="auto")
        assert info.follow_bootstrap_room is False
        assert mapping.target_tp_ranks == (0, 1) and mapping.required_prefill_response_num == 2
        await client.register_dp_rank("127.0.0.1", server.port, 2**63 - 1, 1)
        await client.register_dp_rank("127.0.0.1", server.port, 8, 0)
        dps = await client.query_dp_ranks("127.0.0.1", server.port, [2**63 - 1, 8, 9])
        assert dps == {2**63 - 1: 1, 8: 0}
        assert await client.query_dp_ranks("127.0.0.1", server.port, []) == {}
        found = await client.get_rank_addresses("127.0.0.1", server.port, mapping, dps[2**63 - 1])
        assert found == {(1, 0, 0, 0): RankAddress("10.0.1.0", 17010),
                         (1, 0, 1, 0): RankAddress("10.0.1.1", 17011)}
        with pytest.raises(TopologyMismatch, match="decode page_size 32 != prefill page_size 16"):
            await client.get_mapping("127.0.0.1", server.port, DecodeParallel(1, 0),
                                     page_size=32, kv_cache_dtype="auto")
        assert await client.health("127.0.0.1", server.port)
    # Seven calls; only the two concurrent cell lookups needed a second connection.
    assert sum(server.calls[k] for k in ("route", "register_dp_rank", "query_dp_ranks", "health")) == 7
    assert len(server.peers) <= 2


async def test_prefill_dp_follows_the_room_without_asking(make_server: Any) -> None:
    following = dataclasses.replace(TOPOLOGY, follow_bootstrap_room=True)
    server = await make_server(topology=following)
    async with BootstrapClient(FAST) as client:
        assert await client.prefill_dp("127.0.0.1", server.port, 7) == 1
        assert await client.prefill_dp("127.0.0.1", server.port, 2**63 - 2) == 0
    assert server.calls["query_dp_ranks"] == 0 and server.calls["topology"] == 1


async def test_bearer_token_on_posts(make_server: Any) -> None:
    server = await make_server(token="s3cret")
    async with BootstrapClient(FAST) as client:
        with pytest.raises(BootstrapAuthError, match="--auth-token") as err:
            await client.register_dp_rank("127.0.0.1", server.port, 5, 1)
        assert "missing or wrong bearer token" in str(err.value)
    config = BootstrapClientConfig(retry_interval_s=0.02, tries=5, auth_token="s3cret")
    async with BootstrapClient(config) as client:
        await client.register_dp_rank("127.0.0.1", server.port, 5, 1)
        assert await client.query_dp_ranks("127.0.0.1", server.port, [5]) == {5: 1}
    assert server.auth_seen == [None, "Bearer s3cret", "Bearer s3cret"]


async def test_ipv6_loopback(make_server: Any) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"this machine has no IPv6 loopback ({exc}); the bracketing is still unit-tested")
    server = await make_server(host="::1")
    async with BootstrapClient(FAST) as client:
        assert await client.get_topology("::1", server.port) == TOPOLOGY
        assert await client.get_topology("[::1]", server.port) == TOPOLOGY
    assert server.calls["topology"] == 1, "::1 and [::1] are one cache entry"


def test_address_formatting() -> None:
    assert format_addr("::1", 8998) == "[::1]:8998"
    assert format_addr("[fe80::1]", 1) == "[fe80::1]:1"
    assert format_addr("10.0.0.1", 65535) == "10.0.0.1:65535"
    assert parse_addr("[::1]:8998") == ("::1", 8998)
    assert parse_addr("prefill-0.svc:8998") == ("prefill-0.svc", 8998)
    for bad in ("::1:8998", "host", "host:0", "host:99999", ":8998", "host:x"):
        with pytest.raises(ValueError):
            parse_addr(bad)
    with pytest.raises(ValueError, match="port"):
        format_addr("h", 0)


async def test_client_must_be_started_and_config_is_validated() -> None:
    client = BootstrapClient(FAST)
    with pytest.raises(RuntimeError, match="async with"):
        await client.health("127.0.0.1", 8998)
    for bad in (dict(tries=0), dict(timeout_s=0), dict(retry_interval_s=-1), dict(auth_token="a b")):
        with pytest.raises(ValueError):
            BootstrapClientConfig(**bad)


# ---- against kvatlas's own server -------------------------------------------------------------


def _registration(dp: int, tp: int, pp: int, port: int) -> dict[str, Any]:
    """One prefill rank's PUT /route body, as SGLang 0.5.23 sends it."""
    return {
        "attn_tp_size": 4, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 2, "attn_dp_rank": dp, "pp_size": 2, "pp_rank": pp,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": None, "dsv41_spec_layout": None,
        "load_balance_method": "round_robin", "enable_dsa_cache_layer_split": False,
        "enable_kv_cache_sharding": False, "prefill_http_port": 30000,
        "decode_allocation_policy": "early",
    }


async def test_against_the_kvatlas_bootstrap_server() -> None:
    """A decode (tp 2, pp 1) waits on a prefill instance (dp 2, tp 4, pp 2) that registers rank by
    rank, then resolves its four prefill ranks through the room's dp rank."""
    import aiohttp

    from bootstrap.config import BootstrapConfig
    from bootstrap.server import create_app

    config = BootstrapConfig(instance_id="prefill-itest", model="demo/model", host="127.0.0.1",
                             port=free_port(), etcd=None, auth_token="tok")
    runner = web.AppRunner(create_app(config))
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    cells = [(dp, tp, pp) for dp in range(2) for tp in range(4) for pp in range(2)]
    ports = {cell: 20000 + i for i, cell in enumerate(cells)}
    decode_config = BootstrapClientConfig(retry_interval_s=0.02, tries=500, auth_token="tok")
    try:
        async with BootstrapClient(decode_config) as client, aiohttp.ClientSession() as prefill:
            async def not_ready_answers() -> float:
                """Topology queries the server answered 503 (not every rank registered)."""
                async with prefill.get(f"http://127.0.0.1:{config.port}/metrics") as resp:
                    text = await resp.text()
                line = 'kvatlas_bootstrap_route_queries_total{kind="topology",status="503"} '
                return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))

            waiting = asyncio.ensure_future(client.get_topology("127.0.0.1", config.port))
            await wait_until(not_ready_answers, what="the client asks for the topology")
            for cell in cells[:-1]:
                async with prefill.put(f"http://127.0.0.1:{config.port}/route",
                                       json=_registration(*cell, ports[cell]),
                                       headers={"Authorization": "Bearer tok"}) as resp:
                    assert resp.status == 200, await resp.text()
            asked = await not_ready_answers()

            async def asked_twice_more() -> bool:
                return await not_ready_answers() >= asked + 2
            await wait_until(asked_twice_more,
                             what="the client asks twice more with one rank unregistered")
            assert not waiting.done(), "topology answered before the last rank registered"
            last = cells[-1]
            async with prefill.put(f"http://127.0.0.1:{config.port}/route",
                                   json=_registration(*last, ports[last]),
                                   headers={"Authorization": "Bearer tok"}) as resp:
                assert resp.status == 200
            info = await asyncio.wait_for(waiting, timeout=10)
            assert (info.attn_tp_size, info.dp_size, info.pp_size, info.num_ranks) == (4, 2, 2, 16)
            assert info.follow_bootstrap_room is False and info.prefill_http_port == 30000

            _, mapping = await client.get_mapping("127.0.0.1", config.port, DecodeParallel(2, 1),
                                                  page_size=16, kv_cache_dtype="auto")
            assert mapping.target_tp_ranks == (2, 3) and mapping.target_pp_ranks == (0, 1)
            assert mapping.required_prefill_response_num == 4
            with pytest.raises(TopologyMismatch, match="decode kv_cache_dtype 'fp8_e4m3' != prefill"):
                await client.get_mapping("127.0.0.1", config.port, DecodeParallel(2, 1),
                                         page_size=16, kv_cache_dtype="fp8_e4m3")

            room = 2**63 - 5
            assert await client.prefill_dp("127.0.0.1", config.port, room) is None
            await client.register_dp_rank("127.0.0.1", config.port, room, 1)
            dps = await client.query_dp_ranks("127.0.0.1", config.port, [room, 12345])
            assert dps == {room: 1}
            assert await client.prefill_dp("127.0.0.1", config.port, room) == 1
            found = await client.get_rank_addresses("127.0.0.1", config.port, mapping, dps[room])
            assert found == {(1, 0, tp, pp): RankAddress("127.0.0.1", ports[(1, tp, pp)])
                             for tp in (2, 3) for pp in (0, 1)}

            with pytest.raises(UnknownRank, match="dp_rank=2"):
                await client.get_rank_address("127.0.0.1", config.port, 2, 0, 0, 0)
            with pytest.raises(BadResponse, match="dp_rank") as err:
                await client.register_dp_rank("127.0.0.1", config.port, room, 7)
            assert err.value.status == 400
            assert await client.health("127.0.0.1", config.port)
        async with BootstrapClient(BootstrapClientConfig(retry_interval_s=0.02)) as anonymous:
            with pytest.raises(BootstrapAuthError):
                await anonymous.register_dp_rank("127.0.0.1", config.port, room, 0)
            # GETs stay open for decodes without a token
            assert (await anonymous.get_topology("127.0.0.1", config.port)).num_ranks == 16
    finally:
        await runner.cleanup()
