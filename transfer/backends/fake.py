"""Fake backend: no sockets, no I/O. Sender and receiver in one event loop exchange the same
encoded messages through in-memory queues, so the state machine, validation and pool writes are
exactly the real ones (warm-up runs and unit tests). Endpoints look like ``fake://NAME``."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Hashable
from typing import Any

import torch

from transfer.backends._receiver_core import ProtocolReceiver, ReleasePages
from transfer.backends._sender_core import ProtocolSender
from transfer.base import TransferConfig
from transfer.layout import KVLayout, PageSource

#: Live fake senders by endpoint. Per process; a closed sender removes itself.
HUB: dict[str, FakeSender] = {}
_names = itertools.count(1)


class _Pipe:
    """One ordered direction of a fake connection."""

    def __init__(self, deliver: Any) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(deliver))

    async def _pump(self, deliver: Any) -> None:
        while True:
            frames = await self.queue.get()
            await deliver(frames)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class FakeSender(ProtocolSender):
    def __init__(self, config: TransferConfig, layout: KVLayout, source: PageSource, *,
                 name: str | None = None) -> None:
        super().__init__(config, layout, source, host_id="fake", device="cpu")
        self.name = name or f"sender-{next(_names)}"
        self._to_receiver: dict[Hashable, tuple[FakeReceiver, _Pipe]] = {}

    @property
    def endpoint(self) -> str:
        return f"fake://{self.name}"

    @property
    def rank_address(self) -> tuple[str, int]:
        return self.name, 0

    async def _open(self) -> None:
        if self.endpoint in HUB:
            raise ConnectionError(f"{self.endpoint} is already bound by another fake sender")
        HUB[self.endpoint] = self

    async def _shutdown(self) -> None:
        HUB.pop(self.endpoint, None)
        for receiver, pipe in self._to_receiver.values():
            await pipe.close()
            receiver._peer_gone(self.endpoint)
        self._to_receiver.clear()

    def _attach(self, conn: Hashable, receiver: FakeReceiver) -> _Pipe:
        """Called by a receiver that connects; returns the pipe into this sender."""
        self._to_receiver[conn] = (receiver, _Pipe(lambda f: receiver._on_frames(self.endpoint, f)))
        return _Pipe(lambda f: self._on_frames(conn, f))

    def _detach(self, conn: Hashable) -> None:
        item = self._to_receiver.pop(conn, None)
        if item is not None:
            item[1].task.cancel()

    async def _send_frames(self, conn: Hashable, frames: list[Any]) -> None:
        item = self._to_receiver.get(conn)
        if item is None:
            raise ConnectionError(f"fake connection {conn} is closed")
        item[1].queue.put_nowait(frames)


class FakeReceiver(ProtocolReceiver):
    def __init__(self, config: TransferConfig, layout: KVLayout, pool: torch.Tensor, *,
                 receiver_id: str | None = None, release_pages: ReleasePages | None = None) -> None:
        super().__init__(config, layout, pool, receiver_id=receiver_id,
                         release_pages=release_pages, host_id="fake")
        self._pipes: dict[str, _Pipe] = {}
        self._conn = f"fake-conn-{next(_names)}"

    async def _open(self, endpoint: str) -> None:
        sender = HUB.get(endpoint)
        if sender is None:
            raise ConnectionError(f"no fake sender bound at {endpoint}")
        await self._drop(endpoint)
        self._pipes[endpoint] = sender._attach(self._conn, self)

    async def _drop(self, endpoint: str) -> None:
        pipe = self._pipes.pop(endpoint, None)
        if pipe is not None:
            await pipe.close()
        sender = HUB.get(endpoint)
        if sender is not None:
            sender._detach(self._conn)

    def _peer_gone(self, endpoint: str) -> None:
        pipe = self._pipes.pop(endpoint, None)
        if pipe is not None:
            pipe.task.cancel()

    async def _send_frames(self, endpoint: str, frames: list[Any]) -> None:
        pipe = self._pipes.get(endpoint)
        if pipe is None:
            raise ConnectionError(f"not connected to {endpoint}")
        pipe.queue.put_nowait(frames)
