"""The consumer side of one engine's KV events: a ZMQ SUB (plus a DEALER for replay) feeding an
``InstanceIngestor`` strictly in arrival order.

Malformed messages are counted by reason and dropped; nothing a publisher sends can stop the
reader. When the ingestor reports a gap and a replay endpoint is configured, a fresh DEALER sends
``[b"", start_seq]`` to the publisher's ROUTER and the replies ``[b"", topic, seq, payload]`` are
fed in before any further live message (live ones queue in the SUB socket meanwhile), up to the
end marker ``[b"", b"", 0xff*8, b""]``.

The reader hands the loop back every ``TimeSlice`` (10 ms) of work, so a burst of queued events
never holds up the process's other tasks (its lease keepalive above all). What queues meanwhile is
bounded by ZMQ: ``hwm`` messages here (and the publisher's own high-water mark); past that the
publisher drops, the ingestor counts the missing sequence numbers (``dropped``) and replays them
or, when the publisher no longer has them, resyncs the instance.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from index.events.codec import END_SEQ, DecodeLimits, decode_message
from index.events.endpoints import bindable, connectable, is_ipv6, parse_tcp, publisher_binds
from index.events.errors import MalformedEvent
from index.events.ingest import InstanceIngestor, ReplayRequest
from index.events.pacing import TimeSlice

logger = logging.getLogger(__name__)


@dataclass
class SubscriberConfig:
    endpoint: str = "tcp://127.0.0.1:5557"
    """The publisher's KV-event endpoint, as the publisher was given it."""
    replay_endpoint: str | None = None
    """The publisher's replay ROUTER endpoint; None: gaps clear the instance instead."""
    topic: str = ""
    """Topic prefix to subscribe to (empty: everything)."""
    connect: bool | None = None
    """True: connect to ``endpoint``; False: bind it; None: the mirror of the publisher's rule
    (bind when the publisher connects, i.e. for a concrete tcp host; connect to a wildcard
    publisher through loopback). Set True to reach a remote publisher that binds ``*``."""
    model: str | None = None
    """When set, messages whose llm-d topic ``kv@<pod>@<model>`` names another model are refused."""
    hwm: int = 100_000
    """Receive high-water mark (messages): the most a burst queues here while it is applied;
    what the publisher sends past it (and past its own mark) is dropped and then replayed."""
    replay_timeout: float = 5.0
    """Seconds to wait for each replay reply before giving up on the replay."""
    max_message_bytes: int = 64 * 2**20
    """Larger messages are cut by ZMQ itself (MAXMSGSIZE: the connection is reset and the message
    never buffered whole); the gap that leaves is replayed or resynced like any other."""

    def __post_init__(self) -> None:
        parse_tcp(self.endpoint)
        if self.replay_endpoint is not None:
            parse_tcp(self.replay_endpoint)
        if self.replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be > 0, got {self.replay_timeout}")
        if self.hwm < 1:
            raise ValueError(f"hwm must be >= 1 message (0 would make ZMQ's queue unbounded), "
                             f"got {self.hwm}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")

    @property
    def binds(self) -> bool:
        if self.connect is not None:
            return not self.connect
        return not publisher_binds(self.endpoint)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--kv-events", dest="kv_events", default=cls.endpoint,
                            help="the engine's KV-event endpoint (vLLM --kv-events-config endpoint)")
        parser.add_argument("--replay", dest="kv_events_replay", default=None,
                            help="the engine's replay ROUTER endpoint")
        parser.add_argument("--topic", dest="kv_events_topic", default=cls.topic,
                            help="topic prefix to subscribe to")
        parser.add_argument("--kv-events-connect", dest="kv_events_connect", default=None,
                            action=argparse.BooleanOptionalAction,
                            help="force connect (or --no-kv-events-connect: bind) instead of the rule")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SubscriberConfig:
        return cls(endpoint=args.kv_events, replay_endpoint=args.kv_events_replay,
                   topic=args.kv_events_topic, connect=args.kv_events_connect,
                   model=getattr(args, "model", None))


class KVEventSubscriber:
    """Reads one engine's KV events and applies them through ``ingestor``."""

    def __init__(self, config: SubscriberConfig, ingestor: InstanceIngestor) -> None:
        self.config = config
        self.ingestor = ingestor
        self.limits = DecodeLimits(max_payload_bytes=config.max_message_bytes)
        self.received = 0
        self.malformed: Counter[str] = Counter()
        self.apply_errors = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.publishers = 0
        """Publishers connected now (ZMQ handshakes done, not yet disconnected)."""
        self.connections = 0
        """Publisher connections made since start (a reconnecting engine counts again)."""
        self._connected = asyncio.Event()
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._model = config.model.encode() if config.model else None
        # One slice for live and replayed messages alike: a replay is a burst too.
        self._slice = TimeSlice()

    async def start(self) -> None:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, cfg.hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes + 4096)
        if is_ipv6(cfg.endpoint):
            sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        # Stored before bind/connect so that close() releases it even when binding fails;
        # otherwise ctx.term() would wait forever on the orphaned socket.
        self._sub = sub
        # Watched because a PUB drops what it publishes before a subscriber's subscription has
        # reached it (ZMQ's slow joiner): whoever makes an instance routable waits for this.
        self._monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                               | zmq.EVENT_DISCONNECTED)
        self._monitor_task = asyncio.get_running_loop().create_task(
            self._watch_publishers(), name="kv-events-monitor")
        if cfg.binds:
            sub.bind(bindable(cfg.endpoint))
        else:
            sub.connect(connectable(cfg.endpoint))
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-events-sub")
        logger.info("KV events for %s: %s %s", self.ingestor.instance,
                 "bound" if cfg.binds else "connected to", cfg.endpoint)

    async def _watch_publishers(self) -> None:
        mon = self._monitor
        assert mon is not None
        while True:
            event = parse_monitor_message(await mon.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.publishers += 1
                self.connections += 1
                self._connected.set()
                logger.info("KV events for %s: a publisher connected (%d now)",
                         self.ingestor.instance, self.publishers)
            elif event == zmq.EVENT_DISCONNECTED:
                self.publishers = max(0, self.publishers - 1)
                if not self.publishers:
                    self._connected.clear()
                logger.info("KV events for %s: a publisher disconnected (%d left)",
                         self.ingestor.instance, self.publishers)

    async def wait_publisher(self, timeout: float) -> bool:
        """True once a publisher is connected (within ``timeout`` seconds), False otherwise.

        The subscription travels to the publisher right after the handshake, so events sent
        from then on arrive; those published earlier are lost unless replayed."""
        if self._connected.is_set():
            return True
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def last_endpoint(self) -> str:
        assert self._sub is not None, "start() first"
        return self._sub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        sub = self._sub
        assert sub is not None
        while True:
            # Returns at once, without a turn of the loop, while messages are queued: the slice
            # below is what lets the other tasks run during a burst.
            frames = await sub.recv_multipart()
            try:
                await self.handle(frames)
            except Exception:  # a bug must not silence the instance's events for good
                self.malformed["internal_error"] += 1
                logger.exception("KV events for %s: unexpected error", self.ingestor.instance)
            await self._slice.tick()

    async def handle(self, frames: list[bytes], *, replayed: bool = False) -> None:
        """Decode and apply one message; never raises for bad input or a failing index."""
        self.received += 1
        try:
            topic, seq, batch = decode_message(frames, self.limits)
            self._check_topic(topic)
        except MalformedEvent as exc:
            self.malformed[exc.reason] += 1
            logger.debug("KV events for %s: dropped: %s", self.ingestor.instance, exc)
            return
        try:
            action = await self.ingestor.on_batch(seq, batch, replayed=replayed)
        except Exception:
            # The index backend failed (e.g. etcd away and the writer refusing): log, count, keep
            # reading; the writer's own resync covers what it could not take.
            self.apply_errors += 1
            logger.exception("KV events for %s: applying seq %d failed", self.ingestor.instance, seq)
            return
        if isinstance(action, ReplayRequest):
            await self._replay(action.start_seq)

    def _check_topic(self, topic: bytes) -> None:
        if self._model is None or not topic.startswith(b"kv@"):
            return
        parts = topic.split(b"@", 2)
        if len(parts) == 3 and parts[2] != self._model:
            raise MalformedEvent("unknown_model", f"topic {topic[:120]!r} is not for model "
                                 f"{self._model.decode()!r}")

    async def _replay(self, start_seq: int) -> None:
        cfg = self.config
        ok = False
        if cfg.replay_endpoint is None or self._ctx is None:
            await self.ingestor.replay_finished(False)
            return
        # A fresh DEALER per replay: a reply left over from an abandoned replay can never be
        # mistaken for part of this one.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes + 4096)
        if is_ipv6(cfg.replay_endpoint):
            dealer.setsockopt(zmq.IPV6, 1)
        try:
            dealer.connect(connectable(cfg.replay_endpoint))
            # A DEALER with no peer blocks on send: an absent ROUTER must time out, not hang us.
            await asyncio.wait_for(dealer.send_multipart([b"", start_seq.to_bytes(8, "big")]),
                                   cfg.replay_timeout)
            while True:
                reply = await asyncio.wait_for(dealer.recv_multipart(), cfg.replay_timeout)
                if len(reply) == 4 and reply[2] == END_SEQ:
                    ok = True
                    break
                if len(reply) != 4 or reply[0] != b"":
                    self.malformed["bad_replay_frame"] += 1
                    continue
                await self.handle(reply[1:], replayed=True)
                await self._slice.tick()
        except TimeoutError:
            logger.warning("KV events for %s: replay from %d timed out on %s",
                        self.ingestor.instance, start_seq, cfg.replay_endpoint)
        finally:
            dealer.close()
        await self.ingestor.replay_finished(ok)

    def stats(self) -> dict[str, object]:
        return {"instance": self.ingestor.instance, "state": self.ingestor.state,
                "received": self.received, "publishers": self.publishers,
                "connections": self.connections, "malformed": dict(self.malformed),
                "apply_errors": self.apply_errors, "yields": self._slice.yields,
                **self.ingestor.stats.as_dict()}

    async def close(self) -> None:
        for task in (self._task, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._monitor_task = None
        if self._monitor is not None:
            if self._sub is not None:
                self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sub is not None:
            self._sub.close()
            self._sub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
