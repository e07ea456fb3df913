"""The router service: its state, background tasks, routes and HTTP server.

``create_app(config)`` builds a ``RouterApp``; ``start()`` enters the lifecycle contexts (the
etcd mirror and discovery, health checks) and listens; ``close()`` leaves them in reverse order.
The HTTP layer is ``router.http`` rather than aiohttp: see ``router/http/server.py`` for why.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from index.errors import EtcdError
from index.etcd import EtcdClient
from index.sharded import open_reader
from router import handlers
from router.admission import Admission
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.dispatch import Dispatcher
from router.errors import RouterError, json_error, shaped
from router.handlers import Services
from router.health import HealthChecker
from router.http.server import HttpServer, Request, Response, Stream
from router.kv_aware import KvAware
from router.load_scraper import LoadScraper
from router.shared_predictions import PeerPredictions, PredictionPublisher, ShareStats
from router.state import RouterState
from router.upstreams import Upstreams

logger = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 20_000
"""Net new tracked objects between young collections (CPython's default: 700), set once
the router is up."""

Route = Callable[[Request], Awaitable["Response | Stream"]]


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.state = RouterState(config)
        self.upstreams = Upstreams(config, self.state.pools)
        self.dispatcher = Dispatcher(self.state, self.upstreams)
        self.health = HealthChecker(config, self.state.pools, self.upstreams)
        self.health.info_listeners.append(self.state.capacity.on_info)
        self.load = LoadScraper(self.state.pools, self.upstreams, config.load_interval or 1.0,
                                config.health_timeout)
        self.server = HttpServer(self.handle, max_body=config.max_body,
                                 read_timeout=config.client_read_timeout,
                                 limit_hint=" (router --max-body)", on_reject=self._rejected)
        self.port: int | None = None
        self.metrics_server: HttpServer | None = None
        """The separate ``/metrics`` listener, with ``--prometheus-port``."""
        self.metrics_port: int | None = None
        self._stack = contextlib.AsyncExitStack()
        self.admission = Admission(config.max_concurrent_requests, config.queue_size,
                                   config.queue_timeout)
        svc = Services(self.state, self.dispatcher, self.admission)
        self._metrics = functools.partial(handlers.metrics, svc)
        self.routes: dict[str, dict[str, Route]] = {}
        for method, path, handler in (
                ("POST", "/generate", handlers.generate),
                ("POST", "/v1/completions", handlers.completions),
                ("POST", "/v1/chat/completions", handlers.chat),
                ("GET", "/v1/models", handlers.models),
                ("GET", "/health", handlers.health),
                ("GET", "/liveness", handlers.liveness),
                ("GET", "/readiness", handlers.readiness),
                ("GET", "/workers", handlers.list_workers),
                ("POST", "/workers", handlers.add_worker),
                ("DELETE", "/workers", handlers.delete_worker),
                ("GET", "/metrics", handlers.metrics),
                ("POST", "/debug/route", handlers.debug_route),
                ("GET", "/debug/index_health", handlers.index_health),
                ("GET", "/admin/thresholds", handlers.get_thresholds),
                ("PUT", "/admin/thresholds", handlers.put_thresholds)):
            self.routes.setdefault(path, {})[method] = functools.partial(handler, svc)
        for methods in self.routes.values():
            if "GET" in methods:
                # HEAD answers as GET does (the server leaves the body out): probes and load
                # balancers check /health, /liveness and /readiness that way.
                methods.setdefault("HEAD", methods["GET"])

    async def handle(self, request: Request) -> Response | Stream:
        """Route one request; every answer is counted by route and status."""
        m = self.state.metrics
        methods = self.routes.get(request.path)
        if methods is None:
            answer: Response | Stream = json_error(404, f"no route {request.path!r}")
            route = "unmatched"
        else:
            route = request.path
            handler = methods.get(request.method)
            if handler is None:
                answer = json_error(405, f"{request.method} is not allowed on {request.path}; "
                                         f"use {' or '.join(sorted(methods))}")
            else:
                try:
                    answer = await handler(request)
                except RouterError as exc:  # the client's mistake, or no worker: its status
                    answer = handlers.error_response(exc)
                except Exception:  # noqa: BLE001 - the router answers, whatever happened
                    logger.exception("unexpected error on %s %s", request.method, request.path)
                    answer = json_error(500, "internal router error (see the router log)")
        answer = shaped(request.path, answer)  # OpenAI's error object on /v1/ routes
        status = answer.status if isinstance(answer, Response) else 200
        m.child(m.requests, route, str(status)).inc()
        return answer

    async def handle_metrics_port(self, request: Request) -> Response | Stream:
        if request.path == "/metrics" and request.method in ("GET", "HEAD"):
            return await self._metrics(request)
        return json_error(404, f"only GET /metrics is served here, not {request.method} "
                               f"{request.path!r}")

    def _rejected(self, status: int) -> None:
        m = self.state.metrics
        m.child(m.requests, "rejected", str(status)).inc()

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Start the background work and listen; returns the bound port.

        Every step goes on one exit stack, which ``close()`` unwinds: when a step fails, the
        ones before it are undone in reverse order (listeners, health checks, etcd, upstreams,
        tokenizer loads)."""
        try:
            await self._stack.enter_async_context(self._tokenizers_ctx())
            await self._stack.enter_async_context(self._upstreams_ctx())
            await self._stack.enter_async_context(self._etcd_ctx())
            await self._stack.enter_async_context(self._health_ctx())
            await self._stack.enter_async_context(self._canary_ctx())
            if self.config.load_interval > 0:
                await self._stack.enter_async_context(_background(
                    self.load.run(), "router-engine-load"))
            self._stack.push_async_callback(
                lambda: self.server.close(grace=self.config.shutdown_grace))
            self.port = await self.server.start(host or self.config.host,
                                                self.config.port if port is None else port)
            if self.config.prometheus_port is not None:
                metrics_server = self.metrics_server = HttpServer(self.handle_metrics_port,
                                                                  max_body=1024)
                self._stack.push_async_callback(lambda: metrics_server.close(grace=0))
                self.metrics_port = await metrics_server.start(
                    self.config.prometheus_host, self.config.prometheus_port)
        except BaseException:
            await self._stack.aclose()
            raise
        return self.port

    async def close(self) -> None:
        """Stop listening, let requests in flight finish (``shutdown_grace``), then stop."""
        await self._stack.aclose()

    @contextlib.asynccontextmanager
    async def _tokenizers_ctx(self) -> AsyncIterator[None]:
        # First: the flags' tokenizers load (a bad one stops the start) before discovery can
        # report records that name theirs.
        tokenizers = self.state.tokenizers
        try:
            await tokenizers.start(self.state.pools.all())
            yield
        finally:
            await tokenizers.close()

    @contextlib.asynccontextmanager
    async def _upstreams_ctx(self) -> AsyncIterator[None]:
        try:
            yield
        finally:
            # Calls still running fail now; their bookkeeping callbacks release the loads.
            self.upstreams.close()

    @contextlib.asynccontextmanager
    async def _etcd_ctx(self) -> AsyncIterator[None]:
        state, cfg = self.state, self.config
        if cfg.etcd is None:
            yield
            return
        async with contextlib.AsyncExitStack() as stack:
            # Closed in reverse order, also when a later part fails to start.
            client = EtcdClient(cfg.etcd)
            stack.push_async_callback(client.close)
            try:
                await client.connect()
            except EtcdError as exc:
                # The mirror and discovery loops keep retrying; static workers serve meanwhile.
                logger.warning("etcd not reachable at start (%s); retrying in the background",
                               exc)
            state.index = await open_reader(stack, client, cfg.layout, cfg.model, cfg.index_etcd)
            state.discovery = InstanceDiscovery(client, cfg.layout, state.pools, cfg.model)
            stack.push_async_callback(state.discovery.close)
            state.discovery.start()
            self._share_predictions(client, stack)
            yield

    def _share_predictions(self, client: EtcdClient, stack: contextlib.AsyncExitStack) -> None:
        """kv_aware: publish this router's predictions, follow the other routers'."""
        state, cfg = self.state, self.config
        policy = state.prefill_policy
        if not cfg.share_predictions or not isinstance(policy, KvAware):
            return
        assert cfg.router_id is not None  # RouterConfig fills it in
        stats = state.shared = ShareStats()
        publisher = PredictionPublisher(client, cfg.layout, cfg.router_id, cfg.share_window,
                                        stats)
        stack.push_async_callback(publisher.close)
        publisher.start()
        peers = PeerPredictions(client, cfg.layout, cfg.router_id, policy.peer_routed,
                                cfg.prediction_catch_up, stats)
        stack.push_async_callback(peers.close)
        peers.start()
        policy.share = publisher.offer

    @contextlib.asynccontextmanager
    async def _health_ctx(self) -> AsyncIterator[None]:
        if not self.config.health_check_enabled:
            yield
            return
        async with _background(self.health.run(), "router-health"):
            yield

    @contextlib.asynccontextmanager
    async def _canary_ctx(self) -> AsyncIterator[None]:
        if self.config.etcd is None:
            yield  # no index: no canary is ever taken
            return
        async with _background(self.state.canaries.run(), "router-canaries"):
            yield


@contextlib.asynccontextmanager
async def _background(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[None]:
    """Run ``work`` as a task while the context is entered; cancelled and awaited on exit."""
    task = asyncio.create_task(work, name=name)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def create_app(config: RouterConfig) -> RouterApp:
    return RouterApp(config)


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


async def serve(config: RouterConfig) -> None:
    app = create_app(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await app.start()
    print(f"kvatlas router listening on http://{config.host}:{app.port} (prefill policy "
          f"{config.effective_prefill_policy}, decode policy "
          f"{config.effective_decode_policy})"
          + (f"; metrics also on http://{config.prometheus_host}:{app.metrics_port}/metrics"
             if app.metrics_port is not None else ""), flush=True)
    # Everything alive now lives as long as the process: keep it out of every GC pass.
    gc.freeze()
    # A request allocates a few hundred tracked objects that die with it: young collections
    # every 700 allocations promoted in-flight requests' objects to older generations, and
    # each pass walked 64 requests' worth of them (7 us per request at 64 in flight).
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
    try:
        await stop.wait()
    finally:
        await app.close()


def run(config: RouterConfig) -> None:
    """Serve until SIGINT/SIGTERM (used by ``kvatlas router serve``)."""
    loop = new_loop(config)
    try:
        loop.run_until_complete(serve(config))
    finally:
        loop.close()
