"""The prefill instance's HTTP app: SGLang's ``/generate`` (``engine.pd.prefill``) and the OpenAI
routes, which carry SGLang's bootstrap fields or vLLM's ``kv_transfer_params``
(``engine.pd.prefill_vllm``). Its own module: the vLLM path builds on the prefill's flow, so the
app that serves both imports both."""
from __future__ import annotations

from aiohttp import web

from engine import server as mono
from engine.pd.common import worker_app
from engine.pd.config import PDConfig
from engine.pd.prefill import generate, prefill_ctx, stats_get
from engine.pd.prefill_vllm import chat_completions, completions
from engine.pd.state import CFG_KEY, RANKS_KEY, RankContext


def create_prefill_app(cfg: PDConfig, ranks: RankContext | None = None) -> web.Application:
    app = worker_app(cfg, prefill_ctx, generate)
    app[CFG_KEY] = cfg
    app[RANKS_KEY] = ranks or RankContext()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/debug/pd", stats_get)
    app.router.add_post("/flush_cache", mono.flush_cache)
    return app
