"""The engine worker's HTTP API (aiohttp): SGLang's native endpoints plus the OpenAI ones.

``create_app(config)`` builds the model, pool, cache and scheduler in the app's cleanup context,
starts the engine loop and (with ``kv_events``) the KV-event publisher, and tears all of it down on
shutdown. Bad input is a 400 with ``{"error": ...}`` (OpenAI's error object on ``/v1/`` routes,
``engine.http_common.error_middleware``); a request that can never fit the KV pool is a 503;
nothing a client sends can stop the process.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from bootstrap.http_limits import bound_reads, runner_options
from engine import openai_api
from engine.aggregated import AGGREGATED_KEY, AggregatedConfig, register
from engine.config import ModelConfig
from engine.errors import BadRequest
from engine.http_common import (
    CONFIG_KEY,
    STATE_KEY,
    EngineState,
    check_fits,
    collect,
    error_middleware,
    json_error,
    read_body,
    sse_end,
    sse_response,
    sse_send,
    state,
    until_disconnected,
)
from engine.metrics import make_registry
from engine.protocol import GenInput, parse_generate
from engine.runner import AsyncEngine, build_scheduler, load_model
from engine.sampling import SamplingParams
from engine.scheduler import RequestOutput, Scheduler
from engine.serve_config import EngineServerConfig
from tokenization import tokenizer_record

logger = logging.getLogger(__name__)
VERSION = "0.1.0"
HEALTH_PROMPT = "health"
"""The text ``/health_generate`` prefills (by the engine's tokenizer) to generate one token."""


def meta_info(rid: str, out: RequestOutput, started: float) -> dict[str, Any]:
    return {"id": rid, "finish_reason": out.finish_reason, "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens, "cached_tokens": out.cached_tokens,
            "e2e_latency": round(time.monotonic() - started, 6)}


# -- SGLang native ----------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    st = state(request)
    inputs, batch, stream = parse_generate(await read_body(request), st.model, st.tokenizer)
    rids = []
    for gi in inputs:
        check_fits(st, gi)
        gi.rid = gi.rid or uuid.uuid4().hex
        rids.append(gi.rid)
    started = time.monotonic()
    with st.engine.claim(rids):  # a batch is refused whole (409) before any item starts
        if stream:
            return await generate_stream(request, st, inputs[0], started)
        results = await until_disconnected(
            request, asyncio.gather(*(collect(st, gi) for gi in inputs)))
    bodies = [{"text": text, "output_ids": ids, "meta_info": meta_info(gi.rid or "", out, started)}
              for gi, (ids, text, out) in zip(inputs, results)]
    return web.json_response(bodies if batch else bodies[0])


async def generate_stream(request: web.Request, st: EngineState, gi: GenInput,
                          started: float) -> web.StreamResponse:
    ids: list[int] = []
    text = ""
    async with contextlib.aclosing(st.engine.generate(gi.prompt, gi.params, gi.rid)) as gen:
        # the engine refuses a request (e.g. one it cannot fit) when it is submitted, so
        # submit before the 200 and the stream headers go out
        out: RequestOutput | None = await anext(gen)
        resp = await sse_response(request)
        while out is not None:
            ids.extend(out.new_ids)
            text += out.text_delta
            if out.error:
                await sse_send(resp, {"error": out.error})
                break
            await sse_send(resp, {"text": text, "output_ids": list(ids),
                                  "meta_info": meta_info(gi.rid or "", out, started)})
            out = await anext(gen, None)
    await sse_end(resp)
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """Healthy when the engine generates one token within 20 s."""
    st = state(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = st.tokenizer.encode(HEALTH_PROMPT, add_special_tokens=True)
    try:
        async with asyncio.timeout(20):
            await collect(st, GenInput(prompt, params))
    except (TimeoutError, RuntimeError) as exc:
        return json_error(503, f"engine did not generate: {exc or 'timeout'}")
    return web.Response(text="")


def max_prompt_tokens(st: EngineState) -> int:
    """Longest prompt this worker can ever serve: the model's positions, and its KV pool (a
    prompt over the pool is a 503 here, which a router would take for a failing worker, so it
    must learn to refuse such a prompt itself)."""
    pool = st.engine.scheduler.pool
    return min(st.model.max_prompt_tokens, pool.num_pages * pool.page_size)


def server_info(st: EngineState) -> dict[str, Any]:
    cfg, m, sched = st.config, st.model, st.engine.scheduler
    tok = tokenizer_record(st.tokenizer)
    return {
        "model_path": st.model_path, "tokenizer_path": tok["source"], "tokenizer": tok,
        "served_model_name": cfg.model_name, "host": cfg.host, "port": cfg.port,
        "tp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": cfg.page_size,
        "context_length": m.max_positions,
        # the limits a router must not exceed when it forwards (a longer prompt or a bigger
        # body is refused here: 400, or 503 past the pool, and 413)
        "max_prompt_tokens": max_prompt_tokens(st), "max_body_bytes": cfg.max_request_bytes,
        "max_total_num_tokens": sched.pool.num_pages * cfg.page_size,
        "max_running_requests": cfg.max_running, "chunked_prefill_size": cfg.max_batch_tokens,
        "disable_radix_cache": not cfg.enable_prefix_cache,
        "disaggregation_mode": "null" if cfg.mode == "monolithic" else cfg.mode,
        "kv_cache_dtype": m.dtype, "dtype": m.dtype, "device": cfg.device,
        "num_kv_pages": cfg.kv_pages, "skip_tokenizer_init": False,
        "kv_events_config": (json.dumps({"publisher": "zmq", "endpoint": cfg.kv_events,
                                         "replay_endpoint": cfg.kv_events_replay,
                                         "topic": cfg.kv_events_topic})
                             if cfg.kv_events else None),
        "version": VERSION, "engine": "kvatlas",
        "internal_states": [{"waiting": len(sched.waiting), "running": len(sched.running),
                             "kv_pages_used": sched.cache.pages_in_use,
                             "kv_pages_total": sched.pool.num_pages,
                             "kv_page_refs": sched.pool.total_refs,
                             "held_requests": len(sched.held)}],
    }


async def get_server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info(state(request)))


def architectures(checkpoint: str | None) -> list[str] | None:
    """The ``architectures`` of a Hugging Face checkpoint's config.json (None for a GGUF)."""
    config = Path(checkpoint or "") / "config.json"
    try:
        arch = json.loads(config.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return arch if isinstance(arch, list) else None


async def get_model_info(request: web.Request) -> web.Response:
    st = state(request)
    spec = st.config.spec
    tok = tokenizer_record(st.tokenizer)
    return web.json_response({
        "model_path": st.model_path, "tokenizer_path": tok["source"], "tokenizer": tok,
        "is_generation": True, "model_type": "kvatlas" if spec.seeded else spec.format,
        "architectures": ["KvatlasByteLM"] if spec.seeded else architectures(spec.checkpoint),
        "served_model_name": st.config.model_name, "preferred_sampling_params": None,
        "weight_version": f"seed-{st.model.seed}" if spec.seeded else "checkpoint",
        "has_image_understanding": False,
        "has_audio_understanding": False, "max_context_length": st.model.max_positions,
        "max_prompt_tokens": max_prompt_tokens(st),
        "max_body_bytes": st.config.max_request_bytes,
    })


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(state(request).registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def flush_cache(request: web.Request) -> web.Response:
    st = state(request)
    n = await st.engine.flush_cache()
    if n is None:
        sched = st.engine.scheduler
        return json_error(400, f"cache not flushed: {len(sched.running)} running and "
                               f"{len(sched.waiting)} waiting requests; retry when idle")
    return web.json_response({"flushed": True, "blocks": n})


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's ``/abort_request``: ``{"rid": ...}`` aborts that request if it is in flight."""
    body = await read_body(request)
    rid = body.get("rid")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("rid", "must be a non-empty string")
    found = await state(request).engine.abort(rid)
    return web.json_response({"rid": rid, "aborted": found})


# -- lifecycle --------------------------------------------------------------------------------
def prepare_model_path(cfg: EngineServerConfig, model: ModelConfig, run_dir: str) -> str:
    """What ``model_path`` reports: a checkpoint's own path; for a seeded model, a directory
    (``--model-path``, or one in ``run_dir``) its ``config.json`` is written to."""
    if not cfg.spec.seeded:
        assert cfg.spec.checkpoint is not None
        return cfg.spec.checkpoint
    path = Path(cfg.model_path) if cfg.model_path else Path(run_dir) / cfg.model_name
    path.mkdir(parents=True, exist_ok=True)
    config_file = path / "config.json"
    if not config_file.exists():
        config_file.write_text(json.dumps(model.hf_config(), indent=2))
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "KvatlasByteTokenizer", "bos_token_id": 256,
             "eos_token_id": 257, "pad_token_id": 258, "model_max_length": model.max_positions}))
    return str(path.resolve())


async def engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Build and start the engine, serve, stop. Each resource's close goes on the exit stack
    as soon as it is opened, so a start that fails at any step (an instance id in use, a port
    in use) closes everything opened before it, in reverse order."""
    cfg = app[CONFIG_KEY]
    model = cfg.model_config
    cfg.check_tp(1)
    if cfg.torch_threads is not None:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    loop = asyncio.get_running_loop()

    def build() -> Scheduler:
        weights, tok = load_model(cfg.spec, device=cfg.device)
        return build_scheduler(model, cfg.kv_pages, cfg.page_size, cfg.max_batch_tokens,
                               cfg.enable_prefix_cache, cfg.max_running, model=weights,
                               tokenizer=tok, host_pages=cfg.host_pages)
    async with contextlib.AsyncExitStack() as stack:
        sched = await loop.run_in_executor(None, build)
        sink = None
        registration = None
        if AGGREGATED_KEY in app:
            # registered (not ready yet) before the engine starts: its first KV events are
            # indexed, and a refused id stops the start before anything serves
            registration = await register(stack, app[AGGREGATED_KEY], sched.tokenizer)
            sink = registration.sink
        elif cfg.kv_events:
            from index.events.publisher import KVEventPublisher, PublisherConfig
            publisher = KVEventPublisher(PublisherConfig(
                endpoint=cfg.kv_events, replay_endpoint=cfg.kv_events_replay,
                topic=cfg.kv_events_topic))
            stack.push_async_callback(publisher.close)
            await publisher.start()
            sink = publisher.drain
        engine = AsyncEngine(sched, event_sink=sink)
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvatlas-engine-"))
        model_path = prepare_model_path(cfg, model, run_dir)
        app[STATE_KEY] = EngineState(cfg, model, sched.tokenizer, engine,
                                     make_registry(engine, cfg.model_name), model_path,
                                     time.time())
        await engine.start()
        stack.push_async_callback(engine.stop)
        if registration is not None:
            registration.serving()
        logger.info("engine %s (%s) ready: %d KV pages of %d tokens, model_path %s, tokenizer %s",
                    cfg.model_name, cfg.mode, cfg.kv_pages, cfg.page_size, model_path,
                    tokenizer_record(sched.tokenizer))
        yield


def create_app(config: EngineServerConfig, cluster: AggregatedConfig | None = None
               ) -> web.Application:
    """The engine's app; with ``cluster``, registered in etcd as an aggregated instance."""
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=config.max_request_bytes)
    bound_reads(app, config.read_timeout_s)
    app[CONFIG_KEY] = config
    if cluster is not None:
        app[AGGREGATED_KEY] = cluster
    app.cleanup_ctx.append(engine_ctx)
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/v1/completions", openai_api.completions)
    r.add_post("/v1/chat/completions", openai_api.chat_completions)
    r.add_get("/v1/models", openai_api.models)
    for path in ("/health", "/liveness", "/readiness"):
        r.add_get(path, health)
    r.add_get("/health_generate", health_generate)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, get_server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, get_model_info)
    r.add_get("/metrics", metrics)
    r.add_post("/abort_request", abort_request)
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/flush_cache", flush_cache)
    return app


def run(config: EngineServerConfig, cluster: AggregatedConfig | None = None) -> None:
    """Serve until interrupted (blocking; used by the CLI)."""
    # a client that hangs up cancels its handler, which aborts its engine requests
    app = create_app(config, cluster)
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True, **runner_options(app))
