"""One keep-alive upstream pool per worker URL, shared by dispatch and the health checks."""
from __future__ import annotations

import asyncio

from router.config import RouterConfig
from router.http.client import UpstreamPool
from router.workers import ETCD, Worker, WorkerPools


class Upstreams:
    def __init__(self, config: RouterConfig, workers: WorkerPools) -> None:
        self.config = config
        self.workers = workers
        self.pools: dict[str, UpstreamPool] = {}
        workers.listeners.append(self._on_worker_change)

    def of(self, worker: Worker) -> UpstreamPool:
        pool = self.pools.get(worker.url)
        if pool is None:
            cfg = self.config
            pool = self.pools[worker.url] = UpstreamPool(
                worker.url, connect_timeout=cfg.connect_timeout,
                read_timeout=cfg.request_timeout, max_idle=cfg.max_connections)
        return pool

    async def get(self, worker: Worker, path: str, timeout: float) -> tuple[int, bytes]:
        """``GET path`` on ``worker`` read whole within ``timeout`` (the background readers'
        call: health info, /metrics); TimeoutError or UpstreamError when it gets no answer."""
        resp = await asyncio.wait_for(self.of(worker).request("GET", path, {}, b""), timeout)
        body = resp.take()
        resp.release()
        return resp.status, body

    def _on_worker_change(self, event: str, worker: Worker) -> None:
        # A departed or moved worker's connections would otherwise linger until their sockets
        # time out (a URL may be shared: static and etcd records of one server). Its calls in
        # flight fail with ``gone_reason``: the client learns which worker vanished, and why.
        if event in ("leave", "moved"):
            in_use = {w.url for w in self.workers.all()}
            for url in [u for u in self.pools if u not in in_use]:
                self.pools.pop(url).close(gone_reason(event, worker, url))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


def gone_reason(event: str, worker: Worker, url: str) -> str:
    """Why calls to ``url`` ended: its ``worker`` left the pool (``event`` "leave") or moved
    to another URL ("moved"), said with the worker's id."""
    name = f"{worker.role} worker {worker.instance_id}"
    if event == "moved":
        return f"{name} moved from {url} to {worker.url}"
    if worker.source == ETCD:
        return (f"{name} at {url} vanished: its etcd record was deleted, its lease expired "
                "or it is no longer routable")
    return f"{name} at {url} was removed from the router's pool (DELETE /workers)"
