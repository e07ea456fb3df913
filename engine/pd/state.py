"""What the prefill and decode halves share: where a leader sits in its instance (``RankContext``,
under ``RANKS_KEY`` with its ``PDConfig`` under ``CFG_KEY``), a rank's ``PUT /route`` fields, and
the start paths' helpers: ``once`` (a close run early at a stop and still on the exit stack for
a failed start) and ``stop_engine``."""
from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bootstrap.registration import route_body
from engine import server as mono
from engine.http_common import STATE_KEY, EngineState
from engine.metrics import make_registry
from engine.pd.config import PDConfig
from engine.ranks.dist import Dist, RankInfo
from engine.ranks.replica import ReplicatedScheduler
from engine.runner import AsyncEngine


@dataclass
class RankContext:
    """Where this leader sits in its instance (a one-rank instance by default)."""

    info: RankInfo = field(default_factory=lambda: RankInfo(0, 1, 1, 1))
    dist: Dist | None = None
    bootstrap_port: int | None = None
    """The instance's bootstrap port as world rank 0 broadcast it."""
    dp_urls: list[str] = field(default_factory=list)
    """HTTP base URL of every DP group's leader (index = dp rank), for world rank 0."""
    event_endpoints: list[str | None] = field(default_factory=list)
    """Per DP rank: where that group's KV events go (world rank 0 binds; empty: not indexed)."""
    replay_endpoints: list[str | None] = field(default_factory=list)
    """Per DP rank: that group's KV-event replay endpoint."""

    def __post_init__(self) -> None:
        if self.dist is None:
            self.dist = Dist(self.info, None)


CFG_KEY = web.AppKey("pd_config", PDConfig)
RANKS_KEY = web.AppKey("pd_ranks", RankContext)


def rank_route(cfg: PDConfig, info: RankInfo, rank_ip: str, rank_port: int,
               http_port: int | None = None) -> dict[str, Any]:
    """This rank's ``PUT /route`` body (``http_port``: the instance's HTTP port, world rank 0's;
    default ``cfg.engine.port``)."""
    return route_body(tp_size=info.tp_size, tp_rank=info.tp_rank, dp_size=info.dp_size,
                      dp_rank=info.dp_rank, rank_ip=rank_ip, rank_port=rank_port,
                      page_size=cfg.engine.page_size, kv_cache_dtype=cfg.kv_dtype,
                      load_balance_method=cfg.load_balance_method,
                      prefill_http_port=http_port or cfg.engine.port or None)


def once(close: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """``close`` run at most once, however often the returned callable is awaited."""
    done = False

    async def run() -> None:
        nonlocal done
        if not done:
            done = True
            await close()
    return run


async def start_engine(app: web.Application, stack: contextlib.AsyncExitStack, cfg: PDConfig,
                       engine: AsyncEngine, replica: ReplicatedScheduler, role: str) -> None:
    """Publish the leader's ``EngineState`` (its model files in a run directory the stack
    removes) and start its engine, whose stop goes on the stack."""
    run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kvatlas-{role}-"))
    model_path = mono.prepare_model_path(cfg.engine, cfg.engine.model_config, run_dir)
    app[STATE_KEY] = EngineState(cfg.engine, cfg.engine.model_config,
                                 replica.tokenizer, engine,
                                 make_registry(engine, cfg.engine.model_name), model_path,
                                 time.time())
    await engine.start()
    stack.push_async_callback(stop_engine, engine, replica)


async def stop_engine(engine: AsyncEngine, replica: ReplicatedScheduler) -> None:
    """Stop the other TP ranks' engine threads, then this rank's."""
    with contextlib.suppress(RuntimeError):
        await engine.call(replica.stop)
    await engine.stop()
