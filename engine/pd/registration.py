"""A prefill rank's registration with its instance's bootstrap server (``PUT /route``), and the
prefill's etcd index writer fed from its prefix cache's events."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp

from engine.pd.config import PDConfig
from engine.pd.dist import RankInfo
from index.events.ingest import InstanceIngestor
from index.events.types import KVEvent, KVEventBatch

log = logging.getLogger(__name__)

PUT_TRIES = 5


def route_body(cfg: PDConfig, info: RankInfo, rank_ip: str, rank_port: int,
               http_port: int | None = None) -> dict[str, Any]:
    """SGLang 0.5.23's registration fields for this rank (``http_port``: the instance's HTTP
    port, world rank 0's; default ``cfg.engine.port``)."""
    return {
        "attn_tp_size": info.tp_size, "attn_tp_rank": info.tp_rank,
        "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": info.dp_size, "attn_dp_rank": info.dp_rank,
        "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": rank_ip, "rank_port": rank_port,
        "page_size": cfg.engine.page_size, "kv_cache_dtype": cfg.kv_dtype,
        "kv_layout": None, "dsv41_spec_layout": None,
        "load_balance_method": cfg.load_balance_method,
        "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
        "prefill_http_port": http_port or cfg.engine.port or None, "decode_allocation_policy": "early",
    }


async def put_route(bootstrap_url: str, body: dict[str, Any], tries: int = PUT_TRIES,
                    first_delay: float = 0.2, token: str | None = None) -> None:
    """``PUT /route``, retried ``tries`` times with doubling backoff (the server may still be
    starting on node 0); ``token``: the bootstrap write token, sent as a bearer token. Raises
    RuntimeError naming the last failure."""
    delay, last = first_delay, ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for attempt in range(1, tries + 1):
            try:
                async with session.put(f"{bootstrap_url}/route", json=body,
                                       headers=headers) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}: {text[:200]}"
                    if 400 <= resp.status < 500:
                        break  # a refused registration does not heal by retrying
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            log.info("PUT %s/route try %d/%d failed: %s", bootstrap_url, attempt, tries, last)
            if attempt < tries:
                await asyncio.sleep(delay)
                delay *= 2
    hint = ("; check that every rank of the instance got the same --auth-token"
            if last.startswith("HTTP 401") else "; check --bootstrap-port and that node 0 is up")
    raise RuntimeError(f"rank could not register with the bootstrap server {bootstrap_url}: "
                       f"{last}{hint}")


class EventFeed:
    """Engine KV events -> ``InstanceIngestor`` (our hashes) -> the instance's index writer.

    The engine's sink is synchronous; batches are queued and applied in order by one task."""

    def __init__(self, ingestor: InstanceIngestor) -> None:
        self.ingestor = ingestor
        self.seq = 0
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def sink(self, events: list[KVEvent]) -> None:
        self._queue.put_nowait(list(events))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pd-index-feed")

    async def _run(self) -> None:
        while True:
            events = await self._queue.get()
            try:
                await self.ingestor.on_batch(self.seq, KVEventBatch(ts=time.time(),
                                                                    events=events))
            except Exception:
                log.exception("indexing KV event batch %d failed", self.seq)
            self.seq += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
