"""Followers -> leader reports (a transfer finished or failed on a TP rank), over ZMQ PUSH/PULL.

The leader's scheduler calls go down the ordered torch.distributed broadcast; results of the
transfers they start come back asynchronously, so they travel on their own channel. Messages are
msgpack maps ``{"kind", "room", "rank", "ok", "error", ...}``.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

Report = dict[str, Any]
COUNTED = ("send", "receive")


class UplinkServer:
    """The leader's end: collects reports per (kind, room)."""

    def __init__(self, host: str = "127.0.0.1", keep_s: float = 600.0) -> None:
        self.host = host
        self.keep_s = keep_s
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._reports: dict[tuple[str, int], list[Report]] = {}
        self._born: dict[tuple[str, int], float] = {}
        self._changed = asyncio.Event()
        self.address = ""
        #: Reports received, by ``{kind}_ok`` / ``{kind}_failed`` (``send_failed``: a TP rank
        #: failed a room, e.g. aborted it when the leader gave it up), for ``/debug/pd``.
        self.counts: dict[str, int] = {}

    async def start(self) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._sock = sock
        self.address = f"tcp://{self.host}:{port}"
        self._task = asyncio.create_task(self._read(), name="pd-uplink")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sock is not None:
            self._sock.close(linger=0)

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            try:
                rep = msgpack.unpackb(raw)
                key = (rep["kind"], int(rep["room"]))
            except Exception:
                logger.warning("dropping a malformed rank report")
                continue
            self._reports.setdefault(key, []).append(rep)
            if key[0] in COUNTED:  # a fixed set of keys, whatever a report says
                count = f"{key[0]}_{'ok' if rep.get('ok') else 'failed'}"
                self.counts[count] = self.counts.get(count, 0) + 1
            self._born.setdefault(key, time.monotonic())
            self._changed.set()
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, t in self._born.items() if now - t > self.keep_s]:
            self._born.pop(key, None)
            self._reports.pop(key, None)

    async def wait(self, kind: str, room: int, n: int, timeout: float) -> list[Report]:
        """The reports of ``n`` ranks for ``room``; fewer when ``timeout`` passes first."""
        key = (kind, room)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while len(self._reports.get(key, [])) < n:
                left = deadline - loop.time()
                if left <= 0:
                    break
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            return list(self._reports.get(key, []))
        finally:
            self._reports.pop(key, None)
            self._born.pop(key, None)


class UplinkClient:
    """A follower's end."""

    def __init__(self, address: str, rank: int) -> None:
        self.rank = rank
        self._sock = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.connect(address)

    async def report(self, kind: str, room: int, ok: bool, error: str | None = None,
                     **extra: Any) -> None:
        await self._sock.send(msgpack.packb({"kind": kind, "room": room, "rank": self.rank,
                                             "ok": ok, "error": error, **extra}))

    def close(self) -> None:
        self._sock.close()
