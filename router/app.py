"""The router's aiohttp app factory: state, background tasks and routes."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from index.errors import EtcdError
from index.etcd import EtcdClient
from index.mirror import BlockMirror
from router import handlers
from router.appkeys import DISPATCHER, HEALTH, STATE
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.dispatch import Dispatcher
from router.health import HealthChecker
from router.state import RouterState

logger = logging.getLogger(__name__)



async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    connector = aiohttp.TCPConnector(limit=state.config.max_connections, limit_per_host=0,
                                     ttl_dns_cache=300)
    state.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    yield
    await app[DISPATCHER].close()
    await state.session.close()


async def _etcd_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    cfg = state.config
    if cfg.etcd is None:
        yield
        return
    client = EtcdClient(cfg.etcd)
    try:
        await client.connect()
    except EtcdError as exc:
        # The mirror and discovery loops keep retrying; static workers serve meanwhile.
        logger.warning("etcd not reachable at start (%s); retrying in the background", exc)
    state.mirror = BlockMirror(client, cfg.layout, cfg.model)
    state.discovery = InstanceDiscovery(client, cfg.layout, state.pools, cfg.model)
    tasks = [state.mirror.start(),
             asyncio.create_task(state.discovery.run(), name="router-discovery")]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await client.close()


async def _health_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    assert state.session is not None
    checker = HealthChecker(state.config, state.pools, state.session)
    app[HEALTH] = checker
    task = asyncio.create_task(checker.run(), name="router-health")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(config: RouterConfig) -> web.Application:
    # One byte over the limit is enough to tell "too large"; handlers turn aiohttp's 413 into JSON.
    app = web.Application(client_max_size=config.max_body,
                          middlewares=[handlers.error_middleware])
    state = RouterState(config)
    app[STATE] = state
    app[DISPATCHER] = Dispatcher(state)
    app.cleanup_ctx.extend([_session_ctx, _etcd_ctx, _health_ctx])
    r = app.router
    r.add_post("/generate", handlers.generate)
    r.add_post("/v1/completions", handlers.completions)
    r.add_post("/v1/chat/completions", handlers.chat)
    r.add_get("/v1/models", handlers.models)
    r.add_get("/health", handlers.health)
    r.add_get("/liveness", handlers.liveness)
    r.add_get("/readiness", handlers.readiness)
    r.add_get("/workers", handlers.list_workers)
    r.add_post("/workers", handlers.add_worker)
    r.add_delete("/workers", handlers.delete_worker)
    r.add_get("/metrics", handlers.metrics)
    r.add_post("/debug/route", handlers.debug_route)
    return app


def new_loop(config: RouterConfig) -> asyncio.AbstractEventLoop:
    """uvloop when installed and wanted (bench/router.py measures the difference), else asyncio."""
    if config.uvloop:
        try:
            import uvloop
        except ImportError:
            logger.info("uvloop not installed; using the asyncio event loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(config: RouterConfig) -> None:
    """Serve until interrupted (used by ``kvatlas router serve``)."""
    loop = new_loop(config)
    asyncio.set_event_loop(loop)
    app = create_app(config)
    # Everything alive now lives as long as the process: keep it out of every GC pass.
    gc.freeze()
    web.run_app(app, host=config.host, port=config.port, access_log=None,
                loop=loop, print=lambda *_: print(
                    f"kvatlas router listening on http://{config.host}:{config.port} "
                    f"(prefill policy {config.effective_prefill_policy}, decode policy "
                    f"{config.effective_decode_policy})", flush=True))
