"""Registers instance keys in real etcd under a lease, the way bootstrap/mirror.py does; and a
polling helper for tests that wait on what the router sees (``waiting.wait_until``)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import waiting

from index.etcd import EtcdClient
from index.keys import KeyLayout, dumps
from index.lease import LeaseSession
from index.owned import LeasedKeys


class Instance:
    def __init__(self, client: EtcdClient, layout: KeyLayout, instance_id: str,
                 record: dict[str, Any], ttl: int = 5) -> None:
        self.layout = layout
        self.instance_id = instance_id
        self.session = LeaseSession(client, ttl)
        self.keys = LeasedKeys(self.session, [layout.ranks_prefix(instance_id)])
        self.record = {"instance_id": instance_id, **record}
        self.keys.set(layout.instance(instance_id), dumps(self.record))
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> Instance:
        self.tasks = [asyncio.create_task(self.session.run()),
                      asyncio.create_task(self.keys.run())]
        assert await self.keys.wait_synced(5)
        return self

    async def update(self, **fields: Any) -> None:
        self.record.update(fields)
        self.keys.set(self.layout.instance(self.instance_id), dumps(self.record))
        assert await self.keys.wait_synced(5)

    async def stop(self, revoke: bool = True) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.tasks = []
        if revoke:
            await self.session.revoke()


async def wait_for(cond: Callable[[], Any], timeout: float = waiting.TIMEOUT_S, *,
                   what: str | None = None) -> None:
    """``waiting.wait_until`` for an async ``cond``, as the router tests call it (a positional
    timeout, a safety net only); ``what`` defaults to the predicate's name."""
    await waiting.wait_until(cond, what=what or getattr(cond, "__qualname__", repr(cond)),
                             timeout=timeout, interval=0.01)
