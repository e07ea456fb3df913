"""Per-instance ingestion counters published to etcd, so that ``kvatlas index stats`` can show them.

Event counters (last sequence number, events applied and refused) live only inside the process
that ingests an engine's KV events (the index agent, or an engine indexing itself). That process
publishes them, under its instance lease, as one small JSON value::

    /{prefix}/v1/stats/{instance_id} -> {"instance_id": ..., "model": ..., "last_seq": 41,
                                         "applied": 812, "rejected": {"unknown_parent": 2},
                                         "blocks": 640, ..., "ts": 1790000000.12}

It is rewritten at most once per ``interval`` and only when a counter changed, so an idle
instance costs etcd nothing; the key vanishes with the lease like every other key of the instance.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from index.keys import KeyLayout, dumps, validate_instance_id
from index.lease import LeaseSession
from index.owned import LeasedKeys

logger = logging.getLogger(__name__)

StatsSource = Callable[[], dict[str, Any]]


def stats_prefix(layout: KeyLayout) -> bytes:
    """``/{prefix}/v1/stats/``: every instance's published ingestion counters."""
    return f"{layout.root}stats/".encode()


def stats_key(layout: KeyLayout, instance_id: str) -> bytes:
    """``/{prefix}/v1/stats/{instance_id}``."""
    return stats_prefix(layout) + validate_instance_id(instance_id).encode()


def parse_stats_key(layout: KeyLayout, key: bytes) -> str:
    """The instance id of a stats key."""
    prefix = stats_prefix(layout)
    if not key.startswith(prefix) or b"/" in key[len(prefix):]:
        raise ValueError(f"not a stats key: {key!r}")
    return key[len(prefix):].decode()


class StatsPublisher:
    """Writes ``source()`` (plus ``"ts"``) to the instance's stats key whenever it changed.

    ``keys`` is a ``LeasedKeys`` on the instance's lease session; it may be shared with the
    instance's other keys (then its owner runs it). ``with_session`` builds a publisher that owns
    a ``LeasedKeys`` of its own and runs it inside ``run()``: the one-call way for an engine::

        pub = StatsPublisher.with_session(session, layout, instance_id, lambda: {...})
        task = asyncio.create_task(pub.run())
    """

    def __init__(self, keys: LeasedKeys, layout: KeyLayout, instance_id: str, source: StatsSource,
                 interval: float = 1.0, *, owns_keys: bool = False) -> None:
        if not 0.05 <= interval <= 3600:
            raise ValueError(f"stats interval must be within [0.05, 3600] s, got {interval}")
        self.keys = keys
        self.key = stats_key(layout, instance_id)
        self.source = source
        self.interval = interval
        self.owns_keys = owns_keys
        self.publishes = 0
        self.errors = 0
        self._last: dict[str, Any] | None = None

    @classmethod
    def with_session(cls, session: LeaseSession, layout: KeyLayout, instance_id: str,
                     source: StatsSource, interval: float = 1.0) -> StatsPublisher:
        # No owned prefix: the stats key is always desired, and sweeping a prefix would also match
        # other instances whose id starts with this one.
        return cls(LeasedKeys(session, []), layout, instance_id, source, interval, owns_keys=True)

    def publish(self) -> bool:
        """Hand the current counters to ``keys`` now if they changed; True when they did."""
        try:
            doc = self.source()
        except Exception:  # a counter bug must not stop the publishing loop
            self.errors += 1
            logger.exception("stats source for %s failed", self.key.decode())
            return False
        if doc == self._last:
            return False
        self._last = doc
        self.keys.set(self.key, dumps({**doc, "ts": round(time.time(), 3)}))
        self.publishes += 1
        return True

    async def run(self) -> None:
        """Publish until cancelled (and run ``keys`` too when this publisher owns it)."""
        keys_task = asyncio.create_task(self.keys.run(), name="stats-keys") if self.owns_keys else None
        try:
            while True:
                self.publish()
                await asyncio.sleep(self.interval)
        finally:
            if keys_task is not None:
                keys_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keys_task
