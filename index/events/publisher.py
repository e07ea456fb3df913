"""A KV-event publisher in the vLLM/SGLang wire format, with a replay ROUTER.

Our engine appends ``KVEvent``s to a list as its prefix cache changes; ``drain(events)`` turns
what has accumulated into one ``KVEventBatch`` and publishes it as ``[topic, seq, payload]`` on a
PUB socket (``seq`` counts from 0 per publisher). The last ``buffer_steps`` batches are kept, and
a ROUTER (always bound) answers ``[identity, b"", start_seq]`` with ``[b"", topic, seq, payload]``
for each kept batch from ``start_seq`` on, then the end marker ``[b"", b"", 0xff*8, b""]``.

PUB sends never block: past the high-water mark ZMQ drops, and the consumer notices the gap and
replays. All sockets are driven from the running asyncio loop (no threads).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from index.events.codec import END_SEQ, Encoding, encode_payload
from index.events.endpoints import bindable, connectable, is_ipv6, parse_tcp, publisher_binds
from index.events.types import KVEvent, KVEventBatch

logger = logging.getLogger(__name__)


@dataclass
class PublisherConfig:
    endpoint: str = "tcp://127.0.0.1:5557"
    """PUB endpoint. Bound for ``*``/``0.0.0.0``/``::`` hosts and ipc/inproc, connected otherwise
    (so with a concrete host the consumer binds). Loopback by default."""
    replay_endpoint: str | None = None
    """ROUTER endpoint for replay (always bound), e.g. ``tcp://127.0.0.1:5558``; None: no replay."""
    topic: str = ""
    """Topic frame of every message (llm-d uses ``kv@<pod>@<model>``)."""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    """Send high-water mark of the PUB socket (messages)."""
    encoding: Encoding = "map"
    """Event encoding: ``map`` (vLLM from mid-2026) or ``array`` (older vLLM)."""
    replay_send_timeout: float = 5.0
    """Seconds one replay message may wait for a consumer that stopped reading before the
    replay is abandoned (the consumer then times out and resyncs)."""

    def __post_init__(self) -> None:
        parse_tcp(self.endpoint)
        if self.replay_endpoint is not None:
            parse_tcp(self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ValueError("replay_endpoint must differ from endpoint")
        if self.buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {self.buffer_steps}")
        if self.hwm < 0:
            raise ValueError(f"hwm must be >= 0, got {self.hwm}")
        if self.replay_send_timeout <= 0:
            raise ValueError(f"replay_send_timeout must be > 0, got {self.replay_send_timeout}")
        if self.encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', got {self.encoding!r}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--kv-events-endpoint", default=cls.endpoint,
                            help="KV-event PUB endpoint (binds for */0.0.0.0/::, connects otherwise)")
        parser.add_argument("--kv-events-replay", default=None,
                            help="KV-event replay ROUTER endpoint (always bound); off by default")
        parser.add_argument("--kv-events-topic", default=cls.topic, help="KV-event topic frame")
        parser.add_argument("--kv-events-buffer", type=int, default=cls.buffer_steps,
                            help="batches kept for replay")
        parser.add_argument("--kv-events-encoding", choices=("map", "array"), default=cls.encoding)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> PublisherConfig:
        return cls(endpoint=args.kv_events_endpoint, replay_endpoint=args.kv_events_replay,
                   topic=args.kv_events_topic, buffer_steps=args.kv_events_buffer,
                   encoding=args.kv_events_encoding)


class KVEventPublisher:
    """Publishes KV-event batches and serves replay; ``start()`` inside a running loop."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.published = 0
        self.dropped = 0
        self.replay_requests = 0
        self.bad_replay_requests = 0
        self.failed_replays = 0

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        # The PUB side is a plain socket on the same context: sends never block, so publish()
        # can be a plain call from engine code (an asyncio socket would hand back futures).
        pub = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        pub.setsockopt(zmq.LINGER, 500)
        if is_ipv6(cfg.endpoint):
            pub.setsockopt(zmq.IPV6, 1)
        # Kept before binding: a bind that fails leaves it for close(), whose context term
        # would otherwise wait forever on an unclosed socket.
        self._pub = pub
        if publisher_binds(cfg.endpoint):
            pub.bind(bindable(cfg.endpoint))
        else:
            pub.connect(connectable(cfg.endpoint))
        if cfg.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            # Without MANDATORY a ROUTER silently drops past its high-water mark, which would cut
            # a long replay short; with it, sends wait for room (and fail for a vanished peer).
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            if is_ipv6(cfg.replay_endpoint):
                router.setsockopt(zmq.IPV6, 1)
            self._router = router
            router.bind(bindable(cfg.replay_endpoint))
            self._replay_task = asyncio.get_running_loop().create_task(
                self._serve_replay(), name="kv-events-replay")
        logger.info("KV events: publishing on %s%s", cfg.endpoint,
                 f", replay on {cfg.replay_endpoint}" if cfg.replay_endpoint else "")

    def last_endpoint(self) -> str:
        """The PUB socket's actual address (useful with port 0 or a bound wildcard)."""
        assert self._pub is not None, "start() first"
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, batch: KVEventBatch) -> int:
        """Send one batch now; returns its sequence number. Never blocks."""
        return self.publish_payload(encode_payload(batch, self.config.encoding))

    def publish_payload(self, payload: bytes) -> int:
        """Send one batch already encoded (``encode_payload``) now; returns its sequence number.

        For a relay, or a load test sending the same bytes many times. Never blocks."""
        if self._pub is None:
            raise RuntimeError("KVEventPublisher.publish() before start()")
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        try:
            # A PUB socket drops rather than blocks; NOBLOCK only guards the connect-mode case
            # where no peer is attached yet.
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload],
                                     flags=zmq.NOBLOCK, copy=False)
            self.published += 1
        except zmq.Again:
            self.dropped += 1
        return seq

    def drain(self, events: list[KVEvent], data_parallel_rank: int | None = None) -> int | None:
        """Publish everything in ``events`` as one batch and empty the list; None if it was empty."""
        if not events:
            return None
        batch = KVEventBatch(time.time(), list(events), data_parallel_rank)
        events.clear()
        return self.publish(batch)

    def replay_from(self, start_seq: int) -> Iterable[tuple[int, bytes]]:
        """Buffered ``(seq, payload)`` from ``start_seq`` on."""
        buf = self._buffer
        if not buf or start_seq > buf[-1][0]:
            return []
        first = buf[0][0]
        skip = max(0, start_seq - first)
        return list(buf)[skip:]

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.bad_replay_requests += 1
                logger.warning("KV events: malformed replay request (%d frames); ignored", len(frames))
                continue
            ident = frames[0]
            start = int.from_bytes(frames[2], "big")
            self.replay_requests += 1
            try:
                await self._send_replay(router, ident, start)
            except (TimeoutError, zmq.ZMQError) as exc:
                # The consumer went away or stopped reading; it will time out and resync.
                self.failed_replays += 1
                logger.warning("KV events: replay from %d abandoned: %s", start, exc)

    async def _send_replay(self, router: zmq.asyncio.Socket, ident: bytes, start: int) -> None:
        timeout = self.config.replay_send_timeout
        for seq, payload in self.replay_from(start):
            await asyncio.wait_for(router.send_multipart(
                [ident, b"", self._topic, seq.to_bytes(8, "big"), payload]), timeout)
        await asyncio.wait_for(router.send_multipart([ident, b"", b"", END_SEQ, b""]), timeout)

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
