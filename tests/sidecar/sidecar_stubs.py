"""A stand-in for the engine beside a sidecar in the in-process tests: an HTTP server whose
``/health`` answer the test sets, and optionally kvatlas's own SGLang-wire bootstrap server.
The sidecar under test talks to both over real sockets."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from bootstrap.config import BootstrapConfig
from bootstrap.http_limits import make_runner
from bootstrap.server import create_app
from kvatlas.etcd_proc import free_port


class Served:
    """An aiohttp runner on a free loopback port: ``serve(runner)`` in ``start``, ``stop()``."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, runner: web.AppRunner) -> None:
        self._runner = runner
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class EngineStub(Served):
    """``/health`` answers ``health_status``; ``/get_server_info`` answers ``info``; other
    paths (``/route`` when it stands in for a wrong --bootstrap-url) answer ``route``."""

    def __init__(self, info: dict[str, Any] | None = None, port: int | None = None) -> None:
        super().__init__(port)
        self.health_status = 200
        self.info = info if info is not None else {"page_size": 16}
        self.route: tuple[int, Any] = (404, "not found")
        self.health_calls = 0

    async def _health(self, _: web.Request) -> web.Response:
        self.health_calls += 1
        return web.Response(status=self.health_status, text="OK")

    async def _info(self, _: web.Request) -> web.Response:
        return web.json_response(self.info)

    async def _route(self, _: web.Request) -> web.Response:
        status, body = self.route
        if isinstance(body, str):
            return web.Response(status=status, text=body)
        return web.json_response(body, status=status)

    async def start(self) -> EngineStub:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_server_info", self._info)
        app.router.add_get("/route", self._route)
        await self.serve(web.AppRunner(app, access_log=None))
        return self


class BootstrapStub(Served):
    """kvatlas's bootstrap server without etcd: the SGLang wire, served in-process."""

    def __init__(self, instance_id: str) -> None:
        super().__init__()
        self.config = BootstrapConfig(instance_id=instance_id, model="tiny", host="127.0.0.1",
                                      port=self.port)

    async def start(self) -> BootstrapStub:
        await self.serve(make_runner(create_app(self.config), access_log=None))
        return self


def rank_body(tp: int, tp_size: int, port: int, ip: str = "127.0.0.1") -> dict[str, Any]:
    """A PUT /route body as SGLang 0.5.23 sends it."""
    return {"attn_tp_size": tp_size, "attn_tp_rank": tp, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": ip, "rank_port": port,
            "page_size": 16, "kv_cache_dtype": "bfloat16", "load_balance_method":
            "follow_bootstrap_room", "decode_allocation_policy": "early"}
