"""Real etcd clients with one behaviour changed, shared by the tests of every watcher."""
from __future__ import annotations

from collections.abc import AsyncIterator

from index.etcd import EtcdClient, EtcdSettings, WatchBatch


class HeldWatchClient(EtcdClient):
    """A real client whose watches, while ``held``, pass on only their first response (etcd's
    "created", sent before any event) and then nothing: the way a stream looks while it hangs
    without an error, or while etcd is still producing a very large revision."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.held = False

    async def watch_prefix(self, prefix: bytes, start_revision: int,  # type: ignore[override]
                           progress_every: float | None = None,
                           fragment: bool = False) -> AsyncIterator[WatchBatch]:
        first = True
        async for batch in super().watch_prefix(prefix, start_revision, progress_every, fragment):
            if self.held and not first:
                continue
            first = False
            yield batch
