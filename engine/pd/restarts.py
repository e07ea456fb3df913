"""Notices, from etcd, that the prefill process behind a bootstrap address changed.

A decode caches each prefill's topology, rank addresses and registered transfer connections. A
prefill restarted on the same ports looks the same to all of them: ZMQ reconnects by itself, the
heartbeat ping is answered, and only the first room fails ("unregistered"), which costs a client
request. The prefill's etcd instance record carries ``started_at`` (new per process) under a new
lease, so following ``/instances/`` tells within a watch round trip that the cached state is
stale, before a request hits it.

A vanished record alone is not acted on: a lease can expire while etcd is unreachable and the
prefill is fine (the heartbeat handles real deaths). The last identity is kept, so a process that
comes back after its old record expired is still noticed as a new one.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

from index.errors import EtcdError
from index.etcd import EtcdClient, WatchBatch
from index.keys import KeyLayout
from index.lease import Backoff

log = logging.getLogger(__name__)

OnChange = Callable[[str, str], Awaitable[None]]
"""``(bootstrap address "host:port", reason)``."""


def _identity(value: bytes) -> tuple[str, object] | None:
    """(bootstrap address, process identity) of a prefill instance record; None otherwise."""
    try:
        doc = json.loads(value)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("role") != "prefill":
        return None
    host, port = doc.get("bootstrap_host"), doc.get("bootstrap_port")
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int):
        return None
    # The form of ``Bootstrap.addr`` (what the decode keys its caches by).
    return f"{host}:{port}", doc.get("started_at")


class PrefillRestarts:
    """Calls ``on_change`` when the process identity in a prefill's record changes."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, on_change: OnChange,
                 progress_every: float = 2.0) -> None:
        self.client = client
        self.prefix = layout.instances_prefix()
        self.on_change = on_change
        self.progress_every = progress_every
        self.known: dict[bytes, tuple[str, object]] = {}
        """Instance key -> (bootstrap address, started_at) as last seen (kept after a delete
        until the next reload)."""
        self.changes = 0
        self._loaded = False

    async def run(self) -> None:
        backoff = Backoff()
        revision = 0
        while True:
            try:
                revision = await self._reload()
                watch = self.client.watch_prefix(self.prefix, revision + 1, self.progress_every)
                async with contextlib.aclosing(watch):
                    async for batch in watch:
                        await self._on_batch(batch)
                        backoff.reset()
            except EtcdError as exc:
                log.warning("prefill restart watch: etcd trouble, retrying: %s", exc)
                await asyncio.sleep(backoff.next())

    async def _reload(self) -> int:
        revision, kvs = await self.client.get_prefix(self.prefix)
        seen: dict[bytes, tuple[str, object]] = {}
        for kv in kvs:
            ident = _identity(kv.value)
            if ident is not None:
                seen[kv.key] = ident
        if self._loaded:  # a reconnect: what changed meanwhile counts too
            for key, new in seen.items():
                old = self.known.get(key)
                if old is not None and old != new:
                    await self._changed(old[0], "a new process registered while disconnected")
        self.known, self._loaded = seen, True
        return revision

    async def _on_batch(self, batch: WatchBatch) -> None:
        for ev in batch.events:
            if not ev.put:
                continue  # see the module docstring: the last identity stays
            old = self.known.get(ev.key)
            ident = _identity(ev.value)
            if ident is None:
                continue
            self.known[ev.key] = ident
            if old is not None and old != ident:
                await self._changed(old[0], "a new process registered under the same id")

    async def _changed(self, addr: str, reason: str) -> None:
        self.changes += 1
        log.info("prefill %s: %s; dropping cached topology, ranks and connections", addr, reason)
        try:
            await self.on_change(addr, reason)
        except Exception:  # one bad callback must not stop following etcd
            log.exception("dropping cached state of prefill %s failed", addr)
