"""ZMQ backend: the prefill rank binds a ROUTER, each decode rank connects one DEALER per prefill
rank. Pages travel as multipart messages whose buffers are sent and received without copies
(``copy=False``; received frames are viewed as tensors and copied once, into the pool).

Both sockets refuse frames larger than anything legitimate (``zmq.MAXMSGSIZE``, sized from the
layout: a decode accepts at most one chunk, a prefill at most a request for its whole pool) by
dropping the connection, so one huge frame cannot make either side allocate it."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Hashable
from typing import Any

import torch
import zmq
import zmq.asyncio

from transfer import wire
from transfer.backends._receiver_core import ProtocolReceiver, ReleasePages
from transfer.backends._sender_core import ProtocolSender
from transfer.base import TransferConfig, host_identity
from transfer.layout import KVLayout, PageSource

logger = logging.getLogger(__name__)

#: Queued messages handled per event-loop turn on a receiver connection.
DRAIN_BATCH = 64
#: Messages a decode's connection queues before ZMQ stops reading its TCP socket (backpressure to
#: the prefill; a DEALER never drops). ZMQ's default, 1000, let one connection queue 1000 frames
#: of up to a chunk + 1 MiB (3 GB at the default chunk size) before the receiver looked at any;
#: 8 bounds that to a few chunks. Throughput and CPU per byte measured the same either way.
RECEIVE_HWM = 8


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


class ZmqSender(ProtocolSender):
    """Binds ``tcp://host:port`` (port 0: a free port, read it from ``rank_address``)."""

    def __init__(self, config: TransferConfig, layout: KVLayout, source: PageSource, *,
                 host: str = "127.0.0.1", port: int = 0, device: str = "cpu") -> None:
        super().__init__(config, layout, source, host_id=host_identity(), device=device)
        self.host, self.port = host, port
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def rank_address(self) -> tuple[str, int]:
        return self.host, self.port

    async def _open(self) -> None:
        sock = _context().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished decode is an error, not a silent drop
        sock.setsockopt(zmq.MAXMSGSIZE, wire.max_request_message_bytes(self.source.num_pages))
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise OSError(f"cannot bind the KV sender at tcp://{self.host}:{self.port}: {e}; "
                          "pick a free port (0 lets the system choose)") from e
        self._sock = sock
        self._reader = asyncio.create_task(self._read(), name=f"kv-sender-{self.port}")
        logger.info("KV sender bound at %s", self.endpoint)

    async def _shutdown(self) -> None:
        if self._reader:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            try:
                await self._on_frames(frames[0].bytes, [f.buffer for f in frames[1:]])
            except Exception:  # one bad message must not stop the rank's data plane
                logger.exception("KV sender failed to handle a message")

    async def _send_frames(self, conn: Hashable, frames: list[Any]) -> None:
        if self._sock is None:
            raise ConnectionError("the KV sender is closed")
        try:
            await self._sock.send_multipart([conn, *frames], copy=False)
        except zmq.ZMQError as e:
            raise ConnectionError(f"decode connection {self._peer_name(conn)}: {e}") from None

    def _peer_name(self, conn: Hashable) -> str:
        return f"zmq:{conn.hex() if isinstance(conn, bytes) else conn}"


class ZmqReceiver(ProtocolReceiver):
    """Connects one DEALER per prefill rank endpoint (``tcp://ip:port``), cached until dropped."""

    def __init__(self, config: TransferConfig, layout: KVLayout, pool: torch.Tensor, *,
                 receiver_id: str | None = None, release_pages: ReleasePages | None = None) -> None:
        super().__init__(config, layout, pool, receiver_id=receiver_id,
                         release_pages=release_pages, host_id=host_identity())
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task] = {}

    async def _open(self, endpoint: str) -> None:
        if not endpoint.startswith("tcp://"):
            raise ConnectionError(f"the zmq backend connects to tcp:// endpoints, got {endpoint!r}")
        await self._drop(endpoint)
        sock = _context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        sock.connect(endpoint)
        self._socks[endpoint] = sock
        self._readers[endpoint] = asyncio.create_task(self._read(endpoint, sock),
                                                      name=f"kv-receiver-{endpoint}")

    async def _drop(self, endpoint: str) -> None:
        reader = self._readers.pop(endpoint, None)
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    async def _read(self, endpoint: str, sock: zmq.asyncio.Socket) -> None:
        # Pages arrive faster than one asyncio wake-up per message can take them: messages that
        # queued while one was handled are drained through a synchronous shadow of the same socket
        # (no future, no loop round trip each), then the loop gets a turn.
        drain = zmq.Socket.shadow(sock.underlying)
        while True:
            frames: list[zmq.Frame] | None = await sock.recv_multipart(copy=False)
            handled = 0
            while frames is not None:
                try:
                    await self._on_frames(endpoint, [f.buffer for f in frames])
                except Exception:
                    logger.exception("KV receiver failed to handle a message from %s", endpoint)
                handled += 1
                frames = None
                if handled < DRAIN_BATCH:
                    with contextlib.suppress(zmq.Again):
                        frames = drain.recv_multipart(zmq.NOBLOCK, copy=False)
            await asyncio.sleep(0)

    async def _send_frames(self, endpoint: str, frames: list[Any]) -> None:
        sock = self._socks.get(endpoint)
        if sock is None:
            raise ConnectionError(f"not connected to {endpoint}")
        try:
            await sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as e:
            raise ConnectionError(f"{endpoint}: {e}") from None
