"""Periodic health checks: ``GET {url}/health`` per worker, with thresholds both ways.

A worker that passes is also asked its ``/server_info`` once, for the longest prompt and the
largest body it takes (router/limits.py)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from router.config import RouterConfig
from router.http.client import UpstreamError
from router.limits import prefer
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
        self.info_listeners: list[Callable[[Worker, Any], None]] = []
        """Told of every /server_info read (e.g. the capacity it states: router/capacity.py)."""

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
        except (TimeoutError, UpstreamError) as exc:
            logger.debug("health check of %s failed: %r", worker.url, exc)
        cfg = self.config
        if ok and not worker.info_asked:
            await self.ask_info(worker)
        if ok:
            worker.health_failures = 0
            worker.health_successes += 1
            if not worker.healthy and worker.health_successes >= cfg.health_success_threshold:
                worker.healthy = True
                logger.info("%s worker %s is healthy again", worker.role, worker.instance_id)
                self.pools.health_changed(worker)
        else:
            worker.health_successes = 0
            worker.health_failures += 1
            if worker.healthy and worker.health_failures >= cfg.health_failure_threshold:
                worker.healthy = False
                logger.warning("%s worker %s is unhealthy (%d failed checks)", worker.role,
                               worker.instance_id, worker.health_failures)
                self.pools.health_changed(worker)
        return ok

    async def ask_info(self, worker: Worker) -> None:
        """Learn ``worker``'s limits from its /server_info; asked again next round when
        it did not answer (a 5xx is no answer: a worker still starting, a proxy before it),
        never again when it answered without one (not every engine does: a 404)."""
        try:
            status, body = await self.upstreams.get(worker, "/server_info",
                                                    self.config.health_timeout)
        except (TimeoutError, UpstreamError) as exc:
            logger.debug("/server_info of %s: %r", worker.url, exc)
            return
        if status >= 500:
            logger.debug("/server_info of %s: status %d", worker.url, status)
            return
        worker.info_asked = True
        try:
            info = json.loads(body) if status == 200 else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            info = None
        for listener in self.info_listeners:
            listener(worker, info)
        stated, known = self.pools.limits.stated(info, worker.instance_id), worker.limits
        # An etcd record's statement stays first: it names this very process.
        limits = prefer(known, stated)
        if limits != known:
            logger.info("%s worker %s takes %s", worker.role, worker.instance_id, limits)
            self.pools.learned(worker, limits)
