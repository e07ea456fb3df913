"""Periodic health checks: ``GET {url}/health`` per worker, with thresholds both ways."""
from __future__ import annotations

import asyncio
import logging

from router.config import RouterConfig
from router.http.client import UpstreamError
from router.upstreams import Upstreams
from router.workers import Worker, WorkerPools

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, config: RouterConfig, pools: WorkerPools,
                 upstreams: Upstreams) -> None:
        self.config = config
        self.pools = pools
        self.upstreams = upstreams
        self.rounds = 0

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.config.health_interval)

    async def check_all(self) -> None:
        workers = self.pools.all()
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))
        self.rounds += 1

    async def check(self, worker: Worker) -> bool:
        ok = False
        try:
            resp = await asyncio.wait_for(self.upstreams.of(worker).request(
                "GET", "/health", {}, b""), self.config.health_timeout)
            resp.release()
            ok = resp.status < 500
        except (UpstreamError, asyncio.TimeoutError) as exc:
            logger.debug("health check of %s failed: %r", worker.url, exc)
        cfg = self.config
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if not worker.healthy and worker.health_successes >= cfg.health_success_threshold:
                worker.healthy = True
                logger.info("%s worker %s is healthy again", worker.role, worker.instance_id)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.healthy and worker.health_failures >= cfg.health_failure_threshold:
                worker.healthy = False
                logger.warning("%s worker %s is unhealthy (%d failed checks)", worker.role,
                               worker.instance_id, worker.health_failures)
        return ok
