"""Real etcd clients with one behaviour changed, shared by the tests of every watcher."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from index.errors import EtcdUnavailable
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


class CutWatchClient(EtcdClient):
    """A real client whose watches, while ``cut``, break at their next response and fail to open:
    a watcher cut off from etcd (its reads and writes still pass), so that what etcd does
    meanwhile (writes, a compaction) is what it finds when it resumes."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.cut = False

    async def watch_prefix(self, prefix: bytes, start_revision: int,  # type: ignore[override]
                           progress_every: float | None = None,
                           fragment: bool = False) -> AsyncIterator[WatchBatch]:
        if self.cut:
            raise EtcdUnavailable("watch link cut (test)", endpoint=self.endpoint, op="watch")
        inner = super().watch_prefix(prefix, start_revision, progress_every, fragment)
        async with contextlib.aclosing(inner):
            async for batch in inner:
                if self.cut:  # progress responses keep coming, so a cut is noticed soon
                    raise EtcdUnavailable("watch link cut (test)", endpoint=self.endpoint,
                                          op="watch")
                yield batch
