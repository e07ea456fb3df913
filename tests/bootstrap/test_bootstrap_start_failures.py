"""A bootstrap server whose start fails at any step leaves nothing behind (real etcd).

The standalone path (``kvatlas bootstrap serve``) starts, in order: the etcd client, the id
claim, the lease task, the mirror task (``RankMirror.start``), the room sweeper (the app's
cleanup contexts) and the listener. A failure is injected at each step; afterwards no task
runs, the port is free, the instance record is gone and a lease already granted is revoked.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from start_checks import Injected, port_free, raising, tasks_left

import bootstrap.server
from bootstrap.config import BootstrapConfig
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.owned import LeasedKeys
from kvatlas.cli import CLIError
from kvatlas.commands.bootstrap import serve
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(60)
IID = "pf-start"


async def _lease_of_record(etcd: EtcdClient, layout: KeyLayout) -> int:
    """Wait until the mirror wrote the instance record (its lease is granted); its lease."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        kv = await etcd.get(layout.instance(IID))
        if kv is not None and kv.lease:
            return kv.lease
        assert loop.time() < deadline, "the mirror never wrote its record"
        await asyncio.sleep(0.05)


STEPS = ["connect", "claim", "lease", "mirror", "sweeper", "listen"]


@pytest.mark.parametrize("step", STEPS)
async def test_a_failed_start_closes_what_it_opened(
        step: str, monkeypatch: pytest.MonkeyPatch, etcd: EtcdClient, etcd_endpoint: str,
        key_prefix: str, layout: KeyLayout) -> None:
    port = free_port()
    config = BootstrapConfig(instance_id=IID, model="m", port=port, lease_ttl=5,
                             etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0),
                             etcd_prefix=key_prefix)
    granted: list[int] = []
    expected: type[BaseException] = Injected
    if step == "connect":
        monkeypatch.setattr(EtcdClient, "connect", raising(step))  # the test's client is connected
    elif step == "claim":
        monkeypatch.setattr("index.presence.connect_and_claim", raising(step))
    elif step == "lease":
        monkeypatch.setattr(LeaseSession, "run", raising(step))
    elif step == "mirror":
        monkeypatch.setattr(LeasedKeys, "run", raising(step))
    elif step == "sweeper":
        @contextlib.asynccontextmanager
        async def failing_sweeper(app: web.Application) -> AsyncIterator[None]:
            granted.append(await _lease_of_record(etcd, layout))
            raise Injected("injected failure at sweeper")
            yield  # pragma: no cover

        monkeypatch.setattr(bootstrap.server, "_sweeper_ctx", failing_sweeper)
    else:
        async def failing_listen(self: Any) -> None:
            granted.append(await _lease_of_record(etcd, layout))
            raise OSError(98, "Address already in use (injected)")

        monkeypatch.setattr(web.TCPSite, "start", failing_listen)
        expected = CLIError
    before = asyncio.all_tasks()
    with pytest.raises(expected):
        await serve(config)
    monkeypatch.undo()
    assert await tasks_left(before) == []
    assert port_free(port), f"port {port} still listening"
    assert await etcd.get(layout.instance(IID)) is None, "the instance record outlived the start"
    _, kvs = await etcd.get_prefix(key_prefix.encode() + b"/")
    assert kvs == []
    for lease in granted:
        assert await etcd.lease_ttl(lease) == -1, f"lease {lease:x} was not revoked"
