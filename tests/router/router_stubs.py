"""Real aiohttp stub workers on free loopback ports: they record what they receive and answer as
scripted (statuses, delays, SSE streams), so router tests watch the real HTTP path."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web
from vllm_stub import producer_params

from kvatlas.etcd_proc import free_port
from router.app import RouterApp, create_app
from router.config import RouterConfig
from tokenization import ByteTokenizer

encode_text = ByteTokenizer().encode_array
"""The ids the reference engine prefills for a text prompt (BOS, then the UTF-8 bytes)."""


class StubWorker:
    """A prefill or decode stand-in serving /generate, /v1/completions, /v1/chat/completions."""

    def __init__(self, role: str, name: str | None = None) -> None:
        self.role = role
        self.name = name or role
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.statuses: list[int] = []
        """Scripted statuses, consumed one per request; 200 once empty."""
        self.delay = 0.0
        self.health_status = 200
        self.server_info: dict[str, Any] | None = None
        """What GET /server_info answers (404 when None)."""
        self.server_info_statuses: list[int] = []
        """Scripted error statuses of GET /server_info, consumed one per call."""
        self.stream_chunks = 3
        self.release_stream: asyncio.Event | None = None
        """When set, a stream pauses after its first chunk until this event is set."""
        self.fail_stream_after_first = False
        self.hold: asyncio.Event | None = None
        """When set, every request waits for this event before it is answered."""
        self.cancelled = 0
        """Requests whose connection the router closed before the answer was complete."""
        self.metrics_text: str | None = None
        """What GET /metrics answers (404 when None): an engine's Prometheus exposition."""
        self.cached_tokens: int | None = None
        """When set, answers report it as ``meta_info.cached_tokens`` (a stream: every event
        carries the running count, as SGLang's do)."""
        self.kv_params: bool = True
        """A prefill asked ``do_remote_decode`` (vLLM's PD protocol) answers
        ``kv_transfer_params`` naming its blocks, as vLLM's pull mode does; False: none (a
        prefill that aborted)."""
        self._cancelled_more = asyncio.Event()
        self.in_flight: set[str] = set()
        """The ``rid`` values being served: a second one in flight gets a 409, as engines do."""
        self.port = free_port()
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rooms(self) -> list[Any]:
        return [b.get("bootstrap_room") for b in self.bodies]

    async def start(self) -> StubWorker:
        app = web.Application()
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._handle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/metrics", self._metrics)
        # An engine aborts a request whose connection went away: so does the stub, and counts it.
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics_text is None:
            return web.Response(status=404, text="no metrics")
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": self.health_status == 200}, status=self.health_status)

    async def _server_info(self, request: web.Request) -> web.Response:
        if self.server_info_statuses:
            status = self.server_info_statuses.pop(0)
            return web.json_response({"error": f"{self.name} scripted {status}"}, status=status)
        if self.server_info is None:
            return web.json_response({"error": "not found"}, status=404)
        return web.json_response(self.server_info)

    async def wait_cancelled(self, n: int) -> None:
        """Until the router has closed ``n`` requests' connections mid-answer."""
        while self.cancelled < n:
            self._cancelled_more.clear()
            await self._cancelled_more.wait()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        rid = body.get("rid")
        rids = [r for r in (rid if isinstance(rid, list) else [rid]) if isinstance(r, str)]
        if self.in_flight.intersection(rids) or len(set(rids)) < len(rids):
            return web.json_response({"error": f"rid {rid!r} is already in flight"}, status=409)
        self.in_flight.update(rids)
        try:
            return await self._answer(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            self._cancelled_more.set()
            raise
        finally:
            self.in_flight.difference_update(rids)

    async def _answer(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        status = self.statuses.pop(0) if self.statuses else 200
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.hold is not None:
            await self.hold.wait()
        if status != 200:
            return web.json_response({"error": f"{self.name} scripted {status}"}, status=status)
        if self.role == "decode" and body.get("stream"):
            return await self._stream(request, body)
        rid = body.get("rid")
        if isinstance(rid, list):  # a batch: one answer per item, as SGLang gives
            return web.json_response([{"text": f"from {self.name}", "worker": self.name,
                                       "meta_info": {"id": r}} for r in rid])
        meta: dict[str, Any] = {"id": rid or request.headers.get("x-request-id")}
        if self.cached_tokens is not None:
            meta["cached_tokens"] = self.cached_tokens
        doc = {"text": f"from {self.name}", "worker": self.name,
               "room": body.get("bootstrap_room"), "meta_info": meta}
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode") and self.kv_params:
            doc["kv_transfer_params"] = vllm_pull_params(self.name, request)
        return web.json_response(doc)

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.stream_chunks):
            chunk = {"text": f"tok{i}", "worker": self.name, "room": body.get("bootstrap_room"),
                     "meta_info": {"id": body.get("rid")}}
            if self.cached_tokens is not None:
                chunk["meta_info"]["cached_tokens"] = self.cached_tokens
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0 and self.release_stream is not None:
                await self.release_stream.wait()
            if i == 0 and self.fail_stream_after_first:
                assert request.transport is not None
                request.transport.close()
                return resp
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def vllm_pull_params(engine_id: str, request: web.Request) -> dict[str, Any]:
    """What a vLLM 0.33 prefill in pull mode answers (``pull_scheduler.request_finished``)."""
    kind = "chatcmpl" if request.path.endswith("/chat/completions") else "cmpl"
    return producer_params(
        mode="pull", engine_id=engine_id,
        request_id=f"{kind}-{request.headers.get('x-request-id')}-0a1b2c3d", host="10.0.0.7",
        port=5600, tp_size=1, block_ids=[3, 4, 5], n_tokens=12)


def router_config(prefills: list[StubWorker], decodes: list[StubWorker],
                  **kw: Any) -> RouterConfig:
    kw.setdefault("retry_initial_backoff", 0.005)
    kw.setdefault("health_interval", 60.0)
    # The stubs stand in for the reference engine, whose ids are the byte tokenizer's.
    kw.setdefault("tokenizers", {None: "byte"})
    return RouterConfig(prefill=[(p.url, None) for p in prefills],
                        decode=[d.url for d in decodes], **kw)


class RouterClient:
    """A router listening on a free loopback port, and an aiohttp session pointed at it: the
    tests speak real HTTP to the router's own server."""

    def __init__(self, app: RouterApp) -> None:
        self.app = app
        self.session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> RouterClient:
        port = await self.app.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        self.session = aiohttp.ClientSession(base_url=self.url)
        return self

    def request(self, method: str, path: str, **kw: Any) -> Any:
        assert self.session is not None
        return self.session.request(method, path, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Any:
        return self.request("POST", path, **kw)

    def put(self, path: str, **kw: Any) -> Any:
        return self.request("PUT", path, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    async def metric_lines(self, name: str) -> list[str]:
        """The /metrics sample lines of ``name`` (e.g. ``kvatlas_router_retries_total``)."""
        text = await (await self.get("/metrics")).text()
        return [line for line in text.splitlines() if line.startswith(name)]

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        await self.app.close()


def router_app(config: RouterConfig) -> RouterApp:
    return create_app(config)
