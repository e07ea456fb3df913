"""The room -> prefill DP rank map behind ``/register_dp_rank`` and ``/query_dp_ranks``.

Entries live ``ttl`` seconds. Insertion order equals age order (a re-registered room moves to
the end), so both the sweep and the size bound only ever look at the oldest end.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class DpRoomMap:
    """Bounded TTL map of bootstrap rooms to DP ranks; a re-registered room takes the last rank."""

    def __init__(self, ttl: float, max_entries: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl <= 0 or max_entries < 1:
            raise ValueError("dp room map needs a positive TTL and a bound of at least 1")
        self.ttl = ttl
        self.max_entries = max_entries
        self._clock = clock
        self._rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.evicted = 0   # dropped by the size bound before they expired
        self.expired = 0   # dropped by the TTL

    def __len__(self) -> int:
        return len(self._rooms)

    def register(self, room: int, dp_rank: int) -> None:
        self._rooms.pop(room, None)
        self._rooms[room] = (dp_rank, self._clock())
        while len(self._rooms) > self.max_entries:
            self._rooms.popitem(last=False)
            self.evicted += 1

    def get(self, room: int) -> int | None:
        entry = self._rooms.get(room)
        if entry is None:
            return None
        if self._clock() - entry[1] > self.ttl:
            return None  # expired, the next sweep drops it
        return entry[0]

    def query(self, rooms: Iterable[int]) -> dict[str, int]:
        """SGLang's answer shape: string keys, unknown or expired rooms left out."""
        out: dict[str, int] = {}
        for room in rooms:
            dp = self.get(room)
            if dp is not None:
                out[str(room)] = dp
        return out

    def sweep(self) -> int:
        """Drop expired entries; returns how many."""
        cutoff = self._clock() - self.ttl
        dropped = 0
        while self._rooms:
            room, (_, ts) = next(iter(self._rooms.items()))
            if ts > cutoff:
                break
            self._rooms.popitem(last=False)
            dropped += 1
        self.expired += dropped
        return dropped
