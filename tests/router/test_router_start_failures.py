"""A router whose start fails at any step leaves nothing behind (real etcd, real sockets).

``RouterApp.start`` starts, in order: the etcd client, the block mirror, worker discovery, the
health checks, the canary checks, the HTTP listener and the ``/metrics`` listener. A failure is
injected at each step; afterwards no task runs and both ports can be bound again.
"""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from start_checks import Injected, port_free, raising, tasks_left

from index.etcd import EtcdClient, EtcdSettings
from index.mirror import BlockMirror
from kvatlas.etcd_proc import free_port
from router.app import create_app
from router.canary import Canaries
from router.config import RouterConfig
from router.discovery import InstanceDiscovery
from router.health import HealthChecker
from router.http.server import HttpServer

pytestmark = pytest.mark.timeout(60)

STEPS = ["connect", "mirror", "discovery", "health", "canaries", "listen", "metrics-listen"]


@pytest.mark.parametrize("step", STEPS)
async def test_a_failed_start_closes_what_it_opened(
        step: str, monkeypatch: pytest.MonkeyPatch, etcd: EtcdClient, etcd_endpoint: str,
        key_prefix: str) -> None:
    port, metrics_port = free_port(), free_port()
    config = RouterConfig(etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0),
                          etcd_prefix=key_prefix, port=port, prometheus_port=metrics_port,
                          health_interval=60, shutdown_grace=0.5)
    app = create_app(config)
    if step == "connect":
        monkeypatch.setattr(EtcdClient, "connect", raising(step))  # the test's client is connected
    elif step == "mirror":
        monkeypatch.setattr(BlockMirror, "start", raising(step))
    elif step == "discovery":
        monkeypatch.setattr(InstanceDiscovery, "start", raising(step))
    elif step == "health":
        monkeypatch.setattr(HealthChecker, "run", raising(step))
    elif step == "canaries":
        monkeypatch.setattr(Canaries, "run", raising(step))
    else:
        real_start = HttpServer.start
        fail_on = port if step == "listen" else metrics_port

        async def start(self: HttpServer, host: str, on: int) -> Any:
            if on == fail_on:
                raise Injected(f"injected failure at {step}")
            return await real_start(self, host, on)

        monkeypatch.setattr(HttpServer, "start", start)
    before = asyncio.all_tasks()
    with pytest.raises(Injected):
        await app.start()
    monkeypatch.undo()
    assert await tasks_left(before) == []
    assert port_free(port), f"the router still listens on {port}"
    assert port_free(metrics_port), f"the router still listens on {metrics_port}"
    await app.close()  # closing after a failed start is harmless
