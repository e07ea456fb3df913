"""Engine KV events in, the instance's block index written: the feed between a prefill's
prefix cache (a synchronous event sink) and its ``InstanceIngestor``."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from index.events.ingest import InstanceIngestor
from index.events.pacing import TimeSlice
from index.events.types import KVEvent, KVEventBatch

logger = logging.getLogger(__name__)


class EventFeed:
    """Engine KV events -> ``InstanceIngestor`` (our hashes) -> the instance's index writer.

    The engine's sink is synchronous; batches are queued and applied in order by one task. The
    queue holds at most ``max_queued`` batches: past that a batch is dropped (counted in
    ``dropped``) and its sequence number skipped, so the ingestor sees the gap and resyncs the
    instance (cleared, then rebuilt as the cache turns over) instead of memory growing without
    bound behind a slow index."""

    def __init__(self, ingestor: InstanceIngestor, max_queued: int = 10_000) -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1 batch, got {max_queued}")
        self.ingestor = ingestor
        self.seq = 0
        """Sequence number of the next batch the sink takes (dropped ones use theirs too)."""
        self.dropped = 0
        """Batches dropped because ``max_queued`` were waiting."""
        self._queue: asyncio.Queue[tuple[int, list[KVEvent]]] = asyncio.Queue(max_queued)
        self._slice = TimeSlice()
        self._task: asyncio.Task[None] | None = None

    def sink(self, events: list[KVEvent]) -> None:
        seq, self.seq = self.seq, self.seq + 1
        try:
            self._queue.put_nowait((seq, list(events)))
        except asyncio.QueueFull:
            if not self.dropped:
                logger.warning("instance %s: %d KV-event batches wait to be indexed; dropping "
                            "(the index resyncs the instance)", self.ingestor.instance,
                            self._queue.maxsize)
            self.dropped += 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="pd-index-feed")

    async def _run(self) -> None:
        while True:
            # No turn of the loop while batches are queued: the slice below gives the engine's
            # other tasks (its lease keepalive among them) theirs.
            seq, events = await self._queue.get()
            try:
                await self.ingestor.on_batch(seq, KVEventBatch(ts=time.time(), events=events))
            except Exception:
                logger.exception("indexing KV event batch %d failed", seq)
            await self._slice.tick()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
