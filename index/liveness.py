"""Whether a get-then-watch follower still hears from an etcd quorum.

A watch alone cannot tell: a member that lost its leader keeps the stream open and (etcd 3.5)
even answers progress requests from its local store, so a follower would say "synced" while
nothing can change any more. Two signals are combined:

- the watch stream itself: a response (events or progress) within ``stale_after`` seconds, which
  catches a stream that hangs without an error (progress requests keep a healthy one talking);
- a linearizable read of one key every ``probe_every`` seconds: it needs the leader, so it fails
  (or times out) within ``stale_after`` once quorum is lost, whichever member the client talks to.

``connected`` is True only while both are recent and no error was seen since the last response.
"""
from __future__ import annotations

import asyncio
import logging
import time

from index.errors import EtcdError
from index.etcd import EtcdClient

logger = logging.getLogger(__name__)


class WatchLiveness:
    """Tracks one follower's contact with etcd; run ``probe()`` as a task next to the watch."""

    def __init__(self, client: EtcdClient, probe_key: bytes, stale_after: float = 3.0,
                 probe_every: float = 1.0) -> None:
        if stale_after <= 0 or probe_every <= 0:
            raise ValueError("stale_after and probe_every must be > 0")
        self.client = client
        self.probe_key = probe_key
        self.stale_after = stale_after
        self.probe_every = probe_every
        self._heard_at: float | None = None
        self._probed_at: float | None = None
        self._broken = True
        self.probe_failures = 0
        self.last_probe_error: str | None = None

    def heard(self) -> None:
        """A watch response, or a full reload, arrived."""
        self._heard_at = time.monotonic()
        self._broken = False
        if self._probed_at is None:
            # The reload that brought us here was itself a linearizable read.
            self._probed_at = self._heard_at

    def broke(self) -> None:
        """The watch or a read failed; disconnected until the next response."""
        self._broken = True

    @property
    def connected(self) -> bool:
        if self._broken or self._heard_at is None or self._probed_at is None:
            return False
        now = time.monotonic()
        return max(now - self._heard_at, now - self._probed_at) <= self.stale_after

    def silent_for(self) -> float:
        """Seconds since the last watch response (inf before the first)."""
        return float("inf") if self._heard_at is None else time.monotonic() - self._heard_at

    async def probe(self) -> None:
        """Linearizable reads until cancelled; never raises on etcd trouble."""
        while True:
            await asyncio.sleep(self.probe_every)
            try:
                await asyncio.wait_for(self.client.get(self.probe_key), self.stale_after)
            except (TimeoutError, EtcdError) as exc:
                self.probe_failures += 1
                msg = str(exc) or type(exc).__name__
                if self.last_probe_error is None:
                    logger.warning("etcd quorum probe of %r failed (%s); marking not connected",
                                   self.probe_key, msg)
                self.last_probe_error = msg
                continue
            if self.last_probe_error is not None:
                logger.info("etcd quorum probe of %r answers again", self.probe_key)
            self.last_probe_error = None
            self._probed_at = time.monotonic()
