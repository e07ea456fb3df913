"""Reads every worker's ``/metrics`` into ``Worker.engine`` (router/engine_load.py says what is
read and how it is used)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from router.engine_load import parse_metrics
from router.http.client import UpstreamError
from router.upstreams import Upstreams
from router.workers import Worker, WorkerPools

logger = logging.getLogger(__name__)


class LoadScraper:
    """Reads every worker's ``/metrics`` every ``interval`` seconds into ``Worker.engine``."""

    def __init__(self, pools: WorkerPools, upstreams: Upstreams, interval: float,
                 timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.pools = pools
        self.upstreams = upstreams
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self.rounds = 0
        self.failures = 0

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval)

    async def scrape_all(self) -> None:
        workers = self.pools.all()
        if workers:
            await asyncio.gather(*(self.scrape(w) for w in workers))
        self.rounds += 1

    async def scrape(self, worker: Worker) -> None:
        try:
            status, body = await self.upstreams.get(worker, "/metrics", self.timeout)
        except (TimeoutError, UpstreamError) as exc:
            self.failures += 1
            logger.debug("/metrics of %s: %r", worker.url, exc)
            return
        if status != 200:
            return
        load = parse_metrics(body.decode("utf-8", "replace"), self.clock())
        if load is not None:
            worker.engine = load
