"""Routing predictions shared between routers through etcd.

Why: the block index shows a routed prompt only once its engine's KV events went through etcd
and back (tens to hundreds of milliseconds). Until then the router that routed it bridges the
lag with its own prediction (``router.kv_aware``), but a conversation whose next turn reaches
another router finds neither, and that router may send it elsewhere. So each router publishes
its predictions and follows everyone else's, which count like its own (without the load
discount: the request they predict is not in this router's load).

Stored form, one key per flush, in a ring of ``SLOTS`` keys per router under its own lease (a
router that dies takes its ring with it; etcd holds at most ``SLOTS`` keys per router)::

    /{prefix}/v1/predictions/{router_id}/{slot:03d}

    value: 4-byte big-endian header length | msgpack header | hashes, little-endian uint64
    header: {"v": 1, "t": unix time of the flush, "items": [[instance, model or None, n], ...]}

Item *k*'s ``n`` hashes follow item *k-1*'s. A follower takes a value's predictions as made when
it arrives, if the value is younger than ``max_age`` by its header time: a live put is
milliseconds old, while a snapshot (start-up, a reload) or a ring rewritten after its router's
new lease holds old ones, which must not come back. (Router clocks must agree within
``max_age``, the prediction catch-up time; skewed ones show as ``stale`` in the metrics.)

A key or value that does not read (``decode`` is strict: no bool for a count, counts that add
up to the hashes, at most ``MAX_ITEMS`` items of valid instance ids) is skipped, counted by
reason in ``refused`` and logged once (``index.follow``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence

from index.access import DEFAULT_LEASE_TTL
from index.errors import MalformedValue
from index.etcd import EtcdClient
from index.follow import Entry, PrefixFollower
from index.framing import finite_number, pack, strict_int, unpack
from index.keys import KeyLayout, validate_instance_id
from index.lease import cancel_and_wait
from index.presence import InstancePresence
from router.errors import RouterError

logger = logging.getLogger(__name__)

VERSION = 1
SLOTS = 64
"""Keys in each router's ring: a flush overwrites the oldest."""
MAX_ITEMS = 512
"""Predictions in one flush; more wait for the next (a burst costs a few more puts, not a
value past etcd's request limit: 512 prompts of 128 blocks are ~0.5 MiB)."""

PeerPrediction = tuple[str, "str | None", tuple[int, ...]]
"""(instance, model, prompt block hashes) another router routed."""


class MalformedPrediction(RouterError, MalformedValue):
    """A predictions value this version cannot read; counted by reason and skipped."""

    def __init__(self, reason: str, detail: str) -> None:
        MalformedValue.__init__(self, reason, detail)


def encode(t: float, items: Sequence[PeerPrediction]) -> bytes:
    hashes = [h for _, _, hs in items for h in hs]
    return pack({"v": VERSION, "t": t, "items": [[i, m, len(h)] for i, m, h in items]},
                struct.pack(f"<{len(hashes)}Q", *hashes))


def decode(raw: bytes) -> tuple[float, list[PeerPrediction]]:
    """(flush time, items) of a value; MalformedPrediction when it is not one, and never another
    exception (the value comes from etcd, where any bytes can be)."""
    header, body = unpack(raw, VERSION, MalformedPrediction)
    items_in = header.get("items")
    t = header.get("t")
    if not isinstance(items_in, list) or not finite_number(t):
        raise MalformedPrediction("bad_header", "items or t missing or ill-typed")
    if len(items_in) > MAX_ITEMS:
        raise MalformedPrediction("bad_header", f"{len(items_in)} items, at most {MAX_ITEMS}")
    if len(body) % 8:
        raise MalformedPrediction("bad_hashes", f"{len(body)} bytes of hashes")
    hashes = struct.unpack(f"<{len(body) // 8}Q", body)
    items: list[PeerPrediction] = []
    at = 0
    for item in items_in:
        # strict_int: ``true`` is no count (a bool is an int to Python).
        if (not isinstance(item, list) or len(item) != 3 or not _instance(item[0])
                or not strict_int(item[2], 0, 2**63)
                or not (item[1] is None or isinstance(item[1], str))):
            raise MalformedPrediction("bad_item", str(item)[:80])
        if at + item[2] > len(hashes):
            raise MalformedPrediction("bad_hashes", f"{len(hashes)} hashes, more announced")
        items.append((item[0], item[1], hashes[at:at + item[2]]))
        at += item[2]
    if at != len(hashes):
        raise MalformedPrediction("bad_hashes", f"{len(hashes)} hashes for {at} announced")
    return float(t), items


def _instance(value: object) -> bool:
    try:
        validate_instance_id(value)  # type: ignore[arg-type]
    except ValueError:
        return False
    return True


@dataclasses.dataclass
class ShareStats:
    flushes: int = 0
    """Values written (etcd puts, one per flush)."""
    shared: int = 0
    """Predictions published."""
    bytes: int = 0
    """Bytes of the values written."""
    received: int = 0
    """Other routers' predictions taken."""
    stale: int = 0
    """Predictions skipped as older than ``max_age`` (a snapshot or a lease rewrite)."""

    def since(self, before: ShareStats) -> ShareStats:
        """What was counted after ``before`` (a copy of these stats taken earlier)."""
        return ShareStats(*(getattr(self, f.name) - getattr(before, f.name)
                            for f in dataclasses.fields(self)))


class PredictionPublisher:
    """Batches this router's predictions and writes each batch to the next slot of its ring."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, router_id: str,
                 window: float = 0.01, stats: ShareStats | None = None,
                 lease_ttl: int = DEFAULT_LEASE_TTL) -> None:
        self.layout = layout
        self.router_id = router_id
        self.window = window
        self.stats = stats or ShareStats()
        # The ring is this router's alone: a previous run's slots are swept on the first sync.
        # The client is the router's: it outlives this presence.
        self.presence = InstancePresence(client, lease_ttl,
                                         owned_prefixes=[layout.predictions_prefix(router_id)],
                                         owns_client=False, name="predictions")
        self.session = self.presence.session
        self.keys = self.presence.keys
        self._buffer: list[PeerPrediction] = []
        self._wake = asyncio.Event()
        self._slot = 0
        self._tasks: list[asyncio.Task[None]] = []

    def offer(self, instance: str, model: str | None, hashes: Sequence[int]) -> None:
        """Queue one prediction (called on the routing path: no I/O here)."""
        self._buffer.append((instance, model, tuple(hashes)))
        self._wake.set()

    def start(self) -> None:
        self.presence.start()
        self._tasks = [asyncio.get_running_loop().create_task(self._flush_loop(),
                                                              name="predictions-flush")]

    async def close(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []
        await self.presence.close()

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            # Gather a window's predictions into one put.
            await asyncio.sleep(self.window)
            self._wake.clear()
            while self._buffer:
                items, self._buffer = self._buffer[:MAX_ITEMS], self._buffer[MAX_ITEMS:]
                self.flush(items)

    def flush(self, items: Sequence[PeerPrediction]) -> None:
        value = encode(time.time(), items)
        self.keys.set(self.layout.prediction(self.router_id, self._slot), value)
        self._slot = (self._slot + 1) % SLOTS
        st = self.stats
        st.flushes += 1
        st.shared += len(items)
        st.bytes += len(value)


class PeerPredictions(PrefixFollower):
    """Follows every router's ring and hands the others' predictions to ``on_peer``."""

    kind = "predictions"

    def __init__(self, client: EtcdClient, layout: KeyLayout, router_id: str,
                 on_peer: Callable[[str, str | None, tuple[int, ...]], None],
                 max_age: float, stats: ShareStats | None = None) -> None:
        super().__init__(client, layout.predictions_prefix(), "shared predictions")
        self.layout = layout
        self.router_id = router_id
        self.on_peer = on_peer
        self.max_age = max_age
        self.stats = stats or ShareStats()

    @property
    def refused(self) -> Counter[str]:
        """Keys and values skipped, by reason (``bad_key``, ``decode``'s)."""
        return self.skipped

    def parse_key(self, key: bytes) -> str:
        return self.layout.parse_prediction(key)

    def decode(self, name: str, value: bytes) -> tuple[float, list[PeerPrediction]] | None:
        # This router's own ring is not read at all (its values are not judged either).
        return decode(value) if name != self.router_id else None

    def load(self, revision: int, entries: list[Entry]) -> None:
        for e in entries:
            self._take(e.data)

    def apply(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.data is not None:
                self._take(e.data)

    def _take(self, value: tuple[float, list[PeerPrediction]]) -> None:
        # Every value is judged by its age: a live put is a few milliseconds old, while a
        # snapshot's slots and a ring rewritten after its router's new lease hold old ones.
        t, items = value
        if time.time() - t > self.max_age:
            self.stats.stale += len(items)
            return
        for instance, model, hashes in items:
            self.on_peer(instance, model, hashes)
        self.stats.received += len(items)
