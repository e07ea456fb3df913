"""The prefill's table of requests and aborts for rooms it has not created yet, bounded.

A decode may ask for a room before the prefill admitted the request (they are dispatched at once),
so a request is kept until ``create(room)``; an abort the same way. Unbounded, this table grew by
whatever peers sent (45 requests with 200k page ids each: +327 MB). So an entry holds no page ids
(the request was validated, and only its page count is needed later), a reason is cut to
``REASON_KEPT`` characters, entries expire after a TTL, and there are at most ``max_entries``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Hashable
from dataclasses import dataclass

from transfer import wire
from transfer.base import TransferError

REASON_KEPT = 256


@dataclass(frozen=True)
class EarlyRequest:
    conn: Hashable
    request: wire.Request
    """The request with its page ids dropped (``num_pages`` says how many there were)."""
    num_pages: int
    at: float


class EarlyTable:
    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._requests: dict[int, list[EarlyRequest]] = {}
        self._aborts: dict[int, tuple[TransferError, float]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add_request(self, conn: Hashable, req: wire.Request, num_pages: int) -> bool:
        """Keep a validated request; False (nothing kept) when the table is full."""
        if not self._room_for_one():
            return False
        self._requests.setdefault(req.room, []).append(
            EarlyRequest(conn, without_page_ids(req), num_pages, time.monotonic()))
        self._count += 1
        return True

    def add_abort(self, room: int, error: TransferError) -> bool:
        """Remember that the decode gave up on ``room`` (its requests are dropped); False when
        the table is full."""
        self._count -= len(self._requests.pop(room, ()))
        if room not in self._aborts and not self._room_for_one():
            return False
        if room not in self._aborts:
            self._count += 1
        short = TransferError(error.room, error.reason[:REASON_KEPT], peer=error.peer)
        self._aborts[room] = (short, time.monotonic())
        return True

    def pop(self, room: int) -> tuple[list[EarlyRequest], TransferError | None]:
        requests = self._requests.pop(room, [])
        abort = self._aborts.pop(room, None)
        self._count -= len(requests) + (abort is not None)
        now = time.monotonic()
        if abort is not None and now - abort[1] > self.ttl_s:
            abort = None
        return [r for r in requests if now - r.at <= self.ttl_s], abort[0] if abort else None

    def _room_for_one(self) -> bool:
        if self._count < self.max_entries:
            return True
        now = time.monotonic()
        for room in [r for r, items in self._requests.items() if now - items[0].at > self.ttl_s]:
            self._count -= len(self._requests.pop(room))
        for room in [r for r, (_, t) in self._aborts.items() if now - t > self.ttl_s]:
            del self._aborts[room]
            self._count -= 1
        return self._count < self.max_entries


def without_page_ids(req: wire.Request) -> wire.Request:
    """``req`` as the prefill keeps it once validated: the page ids only matter to the decode (the
    prefill sends chunks by position), and a request may carry as many as the pool has pages."""
    return dataclasses.replace(req, dst_page_ids=())


def check_request(req: wire.Request, decode_pages: int, own_pages: int) -> str:
    """Why ``req`` is refused ("" when it is fine): its ids must be distinct pages of the
    decode's pool, and no more of them than this rank's pool holds."""
    ids = req.dst_page_ids
    if not wire.is_room(req.room):
        return f"bootstrap_room {req.room!r} is not in {wire.ROOM_RANGE}"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (req.transfer_id, req.dst_rank, req.num_requesters)):
        return "transfer_id, dst_rank and num_requesters must be non-negative integers"
    if not 0 < len(ids) <= own_pages:
        return (f"{len(ids)} destination pages, but a room's KV on this prefill rank is at "
                f"most {own_pages} pages (its pool)")
    if not all(type(i) is int and 0 <= i < decode_pages for i in ids) \
            or len(set(ids)) != len(ids):
        return f"destination page ids must be distinct and within [0, {decode_pages}) (the " \
               "decode's pool)"
    return ""
