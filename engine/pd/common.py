"""Pieces shared by the prefill and decode workers: building one rank's engine, the bootstrap
fields of a PD request, the HTTP app skeleton (errors as JSON: ``engine.http_common``)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bootstrap.http_limits import bound_reads
from engine import server as mono
from engine.errors import BadRequest
from engine.http_common import error_middleware
from engine.kv_pool import KVPool
from engine.model import Combine, SeqChunk, Transformer
from engine.pd.config import PDConfig
from engine.prefix_cache import PrefixCache
from engine.ranks.dist import Dist, RankInfo
from engine.ranks.replica import ReplicatedScheduler
from engine.ranks.uplink import UplinkServer
from engine.runner import load_model
from engine.scheduler import Scheduler
from index.rooms import ROUTER_ROOMS
from transfer import KVLayout
from transfer.layout import dtype_from_name

logger = logging.getLogger(__name__)

ROUTER_HINT = "send PD requests through the router"


class ShardedModel:
    """A KV-head shard of the model whose forward gathers the other TP ranks' partials."""

    def __init__(self, model: Transformer, combine: Combine) -> None:
        self._model = model
        self._combine = combine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def forward(self, chunks: Sequence[SeqChunk], pool: KVPool) -> Any:
        return self._model.forward(chunks, pool, combine=self._combine)


def build_rank(cfg: PDConfig, info: RankInfo, dist: Dist) -> tuple[Scheduler, KVLayout]:
    """This rank's scheduler (model shard, pool shard, prefix cache) and its KV layout."""
    e, m = cfg.engine, cfg.engine.model_config
    heads = info.kv_heads(m.num_kv_heads)
    model, tok = load_model(e.spec, device=e.device, kv_heads=heads)
    pool = KVPool(m.num_layers, m.num_kv_heads, m.head_dim, dtype_from_name(cfg.kv_dtype),
                  e.kv_pages, e.page_size, device=model.device, kv_heads=heads)
    # A decode caches only what it prefills itself (``local_prefill``): KV that arrives by
    # transfer is never stored (``Scheduler.add_prefilled``), so without local prefills the
    # cache stays empty and is off, as it always was.
    cache = PrefixCache(pool, enabled=cfg.caches_prefixes,
                        host_pages=e.host_pages if cfg.mode == "prefill" else 0)
    # every rank detokenizes too: its requests must stop (EOS, stop strings) when the leader's do
    sched = Scheduler(ShardedModel(model, dist.combine()), cache,  # type: ignore[arg-type]
                      max_batch_tokens=e.max_batch_tokens, max_running=e.max_running,
                      tokenizer=tok)
    layout = KVLayout.for_tp(num_layers=m.num_layers, num_heads=m.num_kv_heads,
                             head_dim=m.head_dim, page_size=e.page_size, dtype=cfg.kv_dtype,
                             tp_rank=info.tp_rank, tp_size=info.tp_size)
    return sched, layout


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


def bootstrap_fields(body: dict[str, Any]) -> Bootstrap:
    """The router-injected ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``; 400 naming
    the missing or bad one otherwise."""
    host, port, room = (body.get(k) for k in ("bootstrap_host", "bootstrap_port",
                                              "bootstrap_room"))
    missing = [k for k, v in (("bootstrap_host", host), ("bootstrap_port", port),
                              ("bootstrap_room", room)) if v is None]
    if missing:
        raise BadRequest(missing[0], f"missing ({', '.join(missing)} absent): this worker "
                         f"serves one half of a disaggregated pair; {ROUTER_HINT}")
    if isinstance(room, list) or isinstance(host, list) or isinstance(port, list):
        raise BadRequest("bootstrap_room", "lists of bootstrap fields go with a batch of "
                         "prompts (text or input_ids as a list), one value per prompt")
    if not isinstance(host, str) or not host:
        raise BadRequest("bootstrap_host", "must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise BadRequest("bootstrap_port", f"must be an integer in 1..65535, got {port!r}")
    if room not in ROUTER_ROOMS:  # what the router draws; the KV transfer refuses room 0
        raise BadRequest("bootstrap_room", f"must be an integer in {ROUTER_ROOMS}, got {room!r}")
    return Bootstrap(host, port, room)


def worker_app(cfg: PDConfig, ctx: Callable[[web.Application], AsyncIterator[None]],
               generate: Callable[[web.Request], Any]) -> web.Application:
    """The HTTP surface both PD workers share with the monolithic server (health, info, metrics),
    around the worker's own ``/generate`` and lifecycle ``ctx``; callers add their extra routes."""
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=cfg.engine.max_request_bytes)
    bound_reads(app, cfg.engine.read_timeout_s)
    app.cleanup_ctx.append(ctx)
    r = app.router
    r.add_post("/generate", generate)
    for path in ("/health", "/liveness", "/readiness"):
        r.add_get(path, mono.health)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, mono.get_server_info)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, mono.get_model_info)
    r.add_get("/metrics", mono.metrics)
    return app


async def start_group_leader(cfg: PDConfig, info: RankInfo, dist: Dist
                             ) -> tuple[Scheduler, KVLayout, ReplicatedScheduler,
                                        UplinkServer | None]:
    """Build this rank's engine shard, wrap it so every scheduler change reaches the other TP
    ranks of the group, and (with TP > 1) open the uplink they report transfer results on.
    Returns (scheduler, layout, replicated scheduler, uplink or None)."""
    loop = asyncio.get_running_loop()
    sched, layout = await loop.run_in_executor(None, build_rank, cfg, info, dist)
    replica = ReplicatedScheduler(sched, dist)
    uplink = None
    if info.tp_size > 1:
        uplink = UplinkServer(cfg.engine.host)
        await uplink.start()
        dist.group_broadcast(uplink.address)
    return sched, layout, replica, uplink
