"""Engine KV events in, the instance's block index written: the feed between a prefill's
prefix cache (a synchronous event sink) and its ``InstanceIngestor``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from index.events.ingest import InstanceIngestor
from index.events.types import KVEvent, KVEventBatch

log = logging.getLogger(__name__)


class EventFeed:
    """Engine KV events -> ``InstanceIngestor`` (our hashes) -> the instance's index writer.

    The engine's sink is synchronous; batches are queued and applied in order by one task."""

    def __init__(self, ingestor: InstanceIngestor) -> None:
        self.ingestor = ingestor
        self.seq = 0
        self._queue: asyncio.Queue[list[KVEvent]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    def sink(self, events: list[KVEvent]) -> None:
        self._queue.put_nowait(list(events))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pd-index-feed")

    async def _run(self) -> None:
        while True:
            events = await self._queue.get()
            try:
                await self.ingestor.on_batch(self.seq, KVEventBatch(ts=time.time(),
                                                                    events=events))
            except Exception:
                log.exception("indexing KV event batch %d failed", self.seq)
            self.seq += 1

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
