"""One instance's leased presence in etcd: connect, claim the id, hold a lease, mirror its keys.

Every process that shows itself in etcd (a prefill's bootstrap mirror, a decode's record, the
index agent, the sidecar, a router's shared predictions) does the same steps::

    presence = InstancePresence(client, ttl, owned_prefixes=[...], claim=Claim(key, id))
    await presence.open()          # connect, refuse a live holder of the id, start the loops
    presence.keys.set(key, value)  # desired state, mirrored under the lease
    ...
    await presence.close()         # stop the loops, revoke (keys vanish now), close the client

so the revoke timeout, the errors a revoke may meet and the order of the steps are written
once. ``close(revoke=False)`` lets the keys expire with the TTL instead, as a crash would.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from index.claim import connect_and_claim
from index.errors import EtcdError
from index.etcd import EtcdClient
from index.lease import LeaseSession, cancel_and_wait
from index.lifecycle import undo_on_failure
from index.owned import LeasedKeys

logger = logging.getLogger(__name__)

REVOKE_TIMEOUT_S = 3.0
"""The longest a clean shutdown waits for etcd to revoke a lease (capped by the client's own
timeout); past it, the keys expire with the lease TTL."""


@dataclass(frozen=True)
class Claim:
    """The instance id a presence refuses to share with a live process (``index.claim``)."""

    key: bytes
    """The instance record's key."""
    instance_id: str
    """The id, for messages and ``InstanceIdInUse``."""
    source: str | None = None
    """The record kind looked at (``"kv-events"`` for agents and sidecars, None for servers)."""
    meanwhile: str = "retrying"
    """What the process does while etcd is away at start (for the log)."""


async def revoke_within(session: LeaseSession, timeout: float = REVOKE_TIMEOUT_S,
                        what: str = "lease") -> None:
    """Revoke ``session``'s lease, waiting at most ``timeout``; never raises on etcd trouble
    (the keys then expire with the lease TTL)."""
    try:
        await asyncio.wait_for(session.revoke(), timeout=timeout)
    except (TimeoutError, EtcdError) as exc:
        logger.warning("revoking the %s failed (%s); its keys expire with the lease TTL", what,
                       exc or type(exc).__name__)


class InstancePresence:
    """A lease (``session``) and the keys kept under it (``keys``), on ``client``.

    ``owns_client``: the presence connects and closes ``client`` (False where several
    presences share one, e.g. a sidecar's successive attachments or a router's client).
    ``claim``: checked by ``open()`` before anything is written; None for no id check.
    """

    def __init__(self, client: EtcdClient, ttl: int, *, owned_prefixes: Iterable[bytes] = (),
                 claim: Claim | None = None, owns_client: bool = True,
                 name: str = "presence") -> None:
        self.client = client
        self.session = LeaseSession(client, ttl)
        # Only ``owned_prefixes`` are swept of a previous run's keys on a full resync.
        self.keys = LeasedKeys(self.session, owned_prefixes)
        self.claim_spec = claim
        self.owns_client = owns_client
        self.name = name
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def running(self) -> bool:
        return bool(self._tasks)

    @property
    def tasks(self) -> list[asyncio.Task[None]]:
        """The lease and key loops (a watcher can tell when one ended)."""
        return list(self._tasks)

    async def claim(self) -> None:
        """Connect and refuse a live holder of the id (InstanceIdInUse); etcd away is no error.
        On InstanceIdInUse an owned client is closed before the error goes on."""
        if self.claim_spec is None:
            if self.owns_client:
                try:
                    await self.client.connect()
                except EtcdError as exc:
                    logger.warning("etcd not reachable at start, retrying: %s", exc)
            return
        c = self.claim_spec
        async with undo_on_failure() as undo:
            if self.owns_client:
                undo.push_async_callback(self.client.close)
            await connect_and_claim(self.client, c.key, c.instance_id, source=c.source,
                                    meanwhile=c.meanwhile)

    def start(self) -> None:
        """Hold the lease and mirror the keys in the background until ``close()``."""
        if self._tasks:
            return
        # One at a time: when the second cannot start, close() still stops the first.
        self._tasks.append(asyncio.create_task(self.session.run(), name=f"{self.name}-lease"))
        self._tasks.append(asyncio.create_task(self.keys.run(), name=f"{self.name}-keys"))

    async def open(self) -> None:
        """``claim()`` then ``start()``; when the start fails, the claim's client is closed."""
        async with undo_on_failure() as undo:
            await self.claim()
            undo.push_async_callback(self.close)
            self.start()

    async def stop(self) -> None:
        """Stop the lease and key loops (nothing is revoked; see ``close``)."""
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def close(self, revoke: bool = True, timeout: float = REVOKE_TIMEOUT_S) -> None:
        """Stop the loops, then with ``revoke`` revoke the lease (its keys vanish now; at most
        ``timeout`` s, capped by the client's timeout), then close an owned client. Stop every
        writer under the lease before this one, so nothing rewrites a key after the revoke."""
        await self.stop()
        if revoke:
            await revoke_within(self.session, min(timeout, self.client.settings.timeout),
                                f"{self.name} lease")
        if self.owns_client:
            await self.client.close()
