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

The get-then-watch loop is ``index.follow.PrefixFollower``: a broken watch resumes, and a stream
that goes silent for ``stale_after`` seconds (a hang without an error) is answered with a fresh
snapshot, so a restart that a stuck stream never delivered is still noticed, compared against
the identities known before. A key or record it cannot read is skipped, counted by reason in
``skipped`` and logged once (``index.follow``); it never stops the watch.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from index.etcd import EtcdClient
from index.follow import Entry, PrefixFollower
from index.keys import KeyLayout
from index.record import PREFILL, InstanceRecord

logger = logging.getLogger(__name__)

OnChange = Callable[[str, str], Awaitable[None]]
"""``(bootstrap address "host:port", reason)``."""


def _identity(rec: InstanceRecord | None) -> tuple[str, object] | None:
    """(bootstrap address, process identity) of a prefill instance record; None otherwise."""
    if rec is None or rec.role != PREFILL:
        return None
    host, port = rec.bootstrap_host, rec.bootstrap_port
    if not host or port is None:
        return None
    # The form of ``Bootstrap.addr`` (what the decode keys its caches by).
    return f"{host}:{port}", rec.started_at


class PrefillRestarts(PrefixFollower):
    """Calls ``on_change`` when the process identity in a prefill's record changes."""

    kind = "instances"

    def __init__(self, client: EtcdClient, layout: KeyLayout, on_change: OnChange,
                 progress_every: float = 2.0, stale_after: float | None = None) -> None:
        # Silence is judged against the progress period: three missed progress answers.
        super().__init__(client, layout.instances_prefix(), "prefill restart watch",
                         3 * progress_every if stale_after is None else stale_after,
                         progress_every)
        self.on_change = on_change
        self.known: dict[bytes, tuple[str, object]] = {}
        """Instance key -> (bootstrap address, started_at) as last seen (kept after a delete
        until the next reload)."""
        self.changes = 0
        self.layout = layout
        self._loaded = False

    # --- the follower's hooks ---------------------------------------------------------------

    def parse_key(self, key: bytes) -> str:
        return self.layout.parse_instance(key)

    def decode(self, name: str, value: bytes) -> InstanceRecord:
        return InstanceRecord.from_json(value, key=self.layout.instance(name), instance_id=name)

    async def load(self, revision: int, entries: list[Entry]) -> None:
        seen: dict[bytes, tuple[str, object]] = {}
        for e in entries:
            ident = _identity(e.data)
            if ident is not None:
                seen[e.key] = ident
        if self._loaded:  # a reload: what changed while not watching counts too
            for key, new in seen.items():
                old = self.known.get(key)
                if old is not None and old != new:
                    await self._changed(old[0], "a new process registered while disconnected")
        self.known, self._loaded = seen, True

    async def apply(self, entries: list[Entry]) -> None:
        for e in entries:
            if not e.put:
                continue  # see the module docstring: the last identity stays
            old = self.known.get(e.key)
            ident = _identity(e.data)
            if ident is None:
                continue
            self.known[e.key] = ident
            if old is not None and old != ident:
                await self._changed(old[0], "a new process registered under the same id")

    async def _changed(self, addr: str, reason: str) -> None:
        self.changes += 1
        logger.info("prefill %s: %s; dropping cached topology, ranks and connections", addr, reason)
        try:
            await self.on_change(addr, reason)
        except Exception:  # one bad callback must not stop following etcd
            logger.exception("dropping cached state of prefill %s failed", addr)
