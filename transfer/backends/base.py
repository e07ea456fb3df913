"""The two sides of a KV transfer, as backends implement them.

A prefill rank owns one :class:`KVSender` (it binds an endpoint that it registers with its bootstrap
server as ``rank_ip``/``rank_port``); a decode rank owns one :class:`KVReceiver`, which connects to
the prefill ranks that the rank mapping names and caches those connections. One transfer is one
``bootstrap_room`` on one rank; both sides expose its :class:`~transfer.base.TransferState`.

Typical use by a prefill worker::

    sender.create(room)                    # on admission: starts the bootstrap clock
    await sender.wait_bootstrapped(room)   # optional: every decode rank asked for the room
    await sender.send(room, page_ids, first_token=t, cached_tokens=c)  # returns after the ack

and by a decode worker::

    result = await receiver.receive(room, [endpoint, ...], reserved_page_ids)
    # result.first_token, result.cached_tokens; on failure TransferError, pages released
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from transfer.base import TransferState, TransferStatus
from transfer.layout import KVLayout, Range


@dataclass(frozen=True)
class Destination:
    """One decode rank that asked a prefill rank for a room, and the box it gets from it."""

    peer: str
    dst_rank: int
    num_pages: int
    layers: Range
    heads: Range


@dataclass(frozen=True)
class ReceiveResult:
    """What a decode rank learns when all KV of a room arrived, validated, and was written."""

    room: int
    first_token: int
    cached_tokens: int
    num_pages: int
    bytes_received: int
    seconds: float
    peers: tuple[str, ...] = field(default=())
    chunks: int = 0


@dataclass
class SenderHooks:
    """Fault injection for tests; empty in production."""

    room_override: dict[int, int] = field(default_factory=dict)
    """Write this room into the pages/final headers instead of the real one (a swapped binding)."""
    corrupt_rooms: set[int] = field(default_factory=set)
    """Flip one byte of the first buffer of every chunk of these rooms in flight (after the
    checksum and the MAC were computed)."""
    from_chunk: int = 0
    """The two hooks above act on chunks from this index on; earlier chunks go out intact."""


class KVSender(ABC):
    """The prefill-rank side: answers decode ranks' requests with pages and final metadata."""

    layout: KVLayout
    hooks: SenderHooks

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where decode ranks connect (``tcp://127.0.0.1:5555``, ``fake://name``)."""

    @property
    @abstractmethod
    def rank_address(self) -> tuple[str, int]:
        """(rank_ip, rank_port) to PUT to the bootstrap server's ``/route``."""

    @abstractmethod
    async def start(self) -> None:
        """Bind the endpoint; after this, ``endpoint`` and ``rank_address`` are valid."""

    @abstractmethod
    async def close(self) -> None:
        """Fail every unfinished transfer and release the endpoint."""

    @abstractmethod
    def create(self, room: int) -> TransferStatus:
        """Start tracking ``room`` (Bootstrapping) and its bootstrap timeout. Idempotent."""

    @abstractmethod
    async def wait_bootstrapped(self, room: int) -> list[Destination]:
        """Wait until every decode rank asked for ``room`` (WaitingForInput)."""

    @abstractmethod
    async def send(self, room: int, page_ids: Sequence[int], *, first_token: int,
                   cached_tokens: int) -> None:
        """Send the pages ``page_ids`` of the local pool and the final metadata to every decode
        rank of ``room``; return once all confirmed (Success). Raises TransferError. The source
        pages must stay unchanged until this returns."""

    @abstractmethod
    def abort(self, room: int, reason: str) -> None:
        """Fail ``room`` here and tell its decode ranks."""

    @abstractmethod
    def poll(self, room: int) -> TransferState | None:
        """State of ``room`` (kept for a while after it ended); None if unknown."""


class KVReceiver(ABC):
    """The decode-rank side: registers its layout, asks for rooms, validates and writes pages."""

    layout: KVLayout

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None:
        """Fail every unfinished transfer (pages released) and close all connections."""

    @abstractmethod
    async def connect(self, endpoint: str) -> KVLayout:
        """Connect to a prefill rank and register this rank's layout, once per connection (cached).
        Returns the prefill rank's layout. Raises TransferError(room=None) naming mismatches."""

    @abstractmethod
    async def receive(self, room: int, peers: Sequence[str], dst_page_ids: Sequence[int], *,
                      num_requesters: int | None = None) -> ReceiveResult:
        """Fill ``dst_page_ids`` of the pool with the KV of ``room`` from ``peers`` (the prefill
        ranks the rank mapping names). Every chunk's room and checksum are checked before any of
        its pages is written; nothing is written until every peer's first chunk passed the room
        check. On failure raises TransferError with ``released_pages`` set (and calls the
        receiver's ``release_pages`` callback)."""

    @abstractmethod
    def abort(self, room: int, reason: str) -> None:
        """Fail ``room`` here (pages released) and tell its prefill ranks."""

    @abstractmethod
    def fail_peer(self, endpoint: str, reason: str) -> list[int]:
        """A prefill rank is gone (e.g. its ``/health`` missed twice): fail its in-flight rooms,
        drop its cached connection and layout. Returns the rooms failed."""

    @abstractmethod
    async def ping(self, endpoint: str, timeout: float) -> bool:
        """One data-plane heartbeat round trip to a connected prefill rank."""

    @abstractmethod
    def poll(self, room: int) -> TransferState | None: ...
