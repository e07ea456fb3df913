"""Peer liveness: probe a prefill rank every ``heartbeat_interval_s``; after
``heartbeat_max_misses`` consecutive misses, declare it dead (the decode worker's hook then fails
that peer's in-flight transfers and drops its cached connection, ``KVReceiver.fail_peer``).

The probe is any coroutine returning True for alive: the decode worker passes an HTTP GET of the
prefill's ``/health`` (as SGLang does); :meth:`HeartbeatMonitor.for_receiver` uses the data-plane
heartbeat message instead.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

from transfer.backends.base import KVReceiver
from transfer.base import TransferConfig

logger = logging.getLogger(__name__)

Probe = Callable[[], Awaitable[bool]]
OnDead = Callable[[str], Awaitable[None] | None]


class HeartbeatMonitor:
    """Runs ``probe`` periodically; calls ``on_dead(reason)`` once, after enough misses, and stops."""

    def __init__(self, name: str, probe: Probe, on_dead: OnDead, config: TransferConfig) -> None:
        self.name, self.probe, self.on_dead, self.config = name, probe, on_dead, config
        self.misses = 0
        self.dead = False
        self.last_error = ""

    @classmethod
    def for_receiver(cls, receiver: KVReceiver, endpoint: str, config: TransferConfig,
                     probe: Probe | None = None) -> HeartbeatMonitor:
        """Watch one prefill rank of ``receiver``; on death, ``receiver.fail_peer(endpoint)``."""
        async def ping() -> bool:
            return await receiver.ping(endpoint, config.heartbeat_interval_s)

        def dead(reason: str) -> None:
            rooms = receiver.fail_peer(endpoint, reason)
            logger.warning("prefill rank %s declared dead (%s); failed rooms %s", endpoint, reason,
                           rooms)

        return cls(endpoint, probe or ping, dead, config)

    async def beat(self) -> bool:
        """One probe; returns False once the peer is declared dead."""
        if self.dead:
            return False
        try:
            ok = await asyncio.wait_for(self.probe(), self.config.heartbeat_interval_s)
            self.last_error = "" if ok else "probe answered not-alive"
        except TimeoutError:
            ok, self.last_error = False, f"no answer within {self.config.heartbeat_interval_s} s"
        except Exception as e:  # any failing probe counts as a miss
            ok, self.last_error = False, f"{type(e).__name__}: {e}"
        if ok:
            self.misses = 0
            return True
        self.misses += 1
        logger.warning("heartbeat to %s missed (%d/%d): %s", self.name, self.misses,
                       self.config.heartbeat_max_misses, self.last_error)
        if self.misses >= self.config.heartbeat_max_misses:
            self.dead = True
            result = self.on_dead(f"{self.misses} consecutive heartbeats missed "
                                  f"({self.last_error})")
            if inspect.isawaitable(result):
                await result
            return False
        return True

    async def run(self) -> None:
        """Probe until the peer is declared dead (cancel the task to stop earlier)."""
        while await self.beat():
            await asyncio.sleep(self.config.heartbeat_interval_s)
