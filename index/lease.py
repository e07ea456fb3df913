"""One etcd lease held alive for one instance, shared by everything that instance writes.

When the lease is lost (expired during an outage, or etcd came back empty) a new one is granted
and every attached writer is told to rewrite its keys, because etcd deleted them with the lease.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from index.errors import EtcdError, LeaseExpired
from index.etcd import EtcdClient

logger = logging.getLogger(__name__)

NewLeaseCallback = Callable[[int], Awaitable[None] | None]


async def cancel_and_wait(*tasks: asyncio.Task[Any] | None) -> None:
    """Cancel ``tasks`` and wait until they are done, cancelling again if one swallowed it.

    A cancellation can be lost inside a library (or by ``asyncio.timeout`` racing an outer
    cancel on Python 3.11); a plain ``cancel(); await gather(...)`` would then hang forever.
    """
    pending = {t for t in tasks if t is not None and not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
        if pending:
            logger.warning("re-cancelling %d task(s) that ignored a cancellation: %s",
                           len(pending), ", ".join(t.get_name() for t in pending))


class Backoff:
    """Capped exponential backoff: 0.2 s, 0.4 s, ... up to ``cap``; ``reset()`` after a success."""

    def __init__(self, first: float = 0.2, cap: float = 5.0) -> None:
        self.first, self.cap, self._next = first, cap, first

    def next(self) -> float:
        delay, self._next = self._next, min(self.cap, self._next * 2)
        return delay

    def reset(self) -> None:
        self._next = self.first


class LeaseSession:
    """Grants a lease of ``ttl`` seconds, refreshes it every ttl/3, and regrants it when lost."""

    def __init__(self, client: EtcdClient, ttl: int = 10) -> None:
        if ttl < 2:
            raise ValueError(f"lease TTL must be at least 2 s (etcd's minimum), got {ttl}")
        self.client = client
        self.ttl = ttl
        self.lease_id: int | None = None
        self.generation = 0
        self.healthy = False
        self.last_error: str | None = None
        self.last_ok = 0.0
        self.late_keepalives = 0
        """Refreshes that started more than ttl/3 after they were due: the event loop was held
        by work that never yields (the lease expires when that lasts ttl)."""
        self._listeners: list[NewLeaseCallback] = []
        self._changed = asyncio.Event()
        self._granted = asyncio.Event()

    def on_new_lease(self, callback: NewLeaseCallback) -> None:
        """Call ``callback(lease_id)`` after every grant, the first one included."""
        self._listeners.append(callback)

    def lost(self, lease_id: int) -> None:
        """A writer saw LeaseExpired for ``lease_id``: regrant now instead of at the next refresh."""
        if self.lease_id == lease_id:
            logger.warning("etcd lease %x lost; granting a new one", lease_id)
            self.lease_id = None
            self._granted.clear()
            self._changed.set()

    async def wait_lease(self) -> int:
        while self.lease_id is None:
            await self._granted.wait()
        return self.lease_id

    async def run(self) -> None:
        """Hold the lease until cancelled. Never raises on etcd trouble; it retries."""
        backoff = Backoff(cap=min(5.0, self.ttl / 3))
        loop = asyncio.get_running_loop()
        while True:
            # Cleared before the attempt so that a lost() during a slow keepalive is not missed.
            self._changed.clear()
            try:
                if self.lease_id is None:
                    lease_id, _ = await self._grant()
                    self.lease_id = lease_id
                    self.generation += 1
                    logger.info("granted etcd lease %x (ttl %d s)", lease_id, self.ttl)
                    self._mark_ok()
                    self._granted.set()
                    for cb in list(self._listeners):
                        res = cb(lease_id)
                        if res is not None:
                            await res
                else:
                    await self.client.keepalive(self.lease_id)
                    self._mark_ok()
                backoff.reset()
                delay = self.ttl / 3
            except LeaseExpired:
                if self.lease_id is not None:
                    self.lost(self.lease_id)
                delay = 0.0
            except EtcdError as exc:
                self._mark_failed(exc)
                delay = backoff.next()
            due = loop.time() + delay
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=delay)
            except TimeoutError:
                pass
            late = loop.time() - due
            if late > self.ttl / 3:
                self.late_keepalives += 1
                logger.warning("etcd lease %s: refresh ran %.1f s late (ttl %d s): the event loop "
                               "was held by work that does not yield", _hex(self.lease_id),
                               late, self.ttl)

    async def _grant(self) -> tuple[int, int]:
        grant = asyncio.ensure_future(self.client.grant(self.ttl))
        try:
            return await asyncio.shield(grant)
        except asyncio.CancelledError:
            # Stopped while the grant was in flight: etcd grants it all the same, and a lease
            # nobody knows would outlive this instance by its TTL. Keep its id for revoke().
            with contextlib.suppress(EtcdError):
                self.lease_id = (await asyncio.shield(grant))[0]
            raise

    def _mark_ok(self) -> None:
        self.healthy = True
        self.last_error = None
        self.last_ok = time.monotonic()

    def _mark_failed(self, exc: EtcdError) -> None:
        if self.healthy or self.last_error != str(exc):
            logger.warning("etcd lease keepalive failed, retrying: %s", exc)
        self.healthy = False
        self.last_error = str(exc)

    async def revoke(self) -> int:
        """Revoke the lease so that its keys vanish now (clean shutdown). Best effort: returns
        the revision at which etcd deleted the keys, 0 when that is unknown (no lease, already
        gone, or etcd unreachable)."""
        lease_id, self.lease_id = self.lease_id, None
        if lease_id is None:
            return 0
        try:
            return await self.client.revoke(lease_id)
        except EtcdError as exc:
            logger.warning("could not revoke lease %x (its keys expire with its TTL): %s",
                           lease_id, exc)
            return 0


def _hex(lease_id: int | None) -> str:
    return "(none)" if lease_id is None else f"{lease_id:x}"
