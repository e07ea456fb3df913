"""The bootstrap room range, defined once.

A bootstrap room names one request's KV transfer between a prefill and a decode. SGLang accepts
rooms in [0, 2^63-1], so every layer that validates a room checks it against ``ROOMS``; the
router draws from ``ROUTER_ROOMS``, which leaves out 0 because some engines treat room 0 as
"unset". This module lives in ``index/`` because that is the one
layer the router, the bootstrap server and the engine may all import. ``transfer/`` imports
nothing of ours: it checks only what its wire carries (a non-zero msgpack uint64).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any


def _bound(value: int) -> str:
    # 2^63-1 reads better in a message than 9223372036854775807.
    for bits in (63, 64):
        if value == 2**bits - 1:
            return f"2^{bits}-1"
    return str(value)


@dataclass(frozen=True)
class RoomRange:
    """The closed range ``[low, high]`` of bootstrap rooms."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"room range [{self.low}, {self.high}] is empty or negative")

    def __contains__(self, value: Any) -> bool:
        # bool is an int subclass: a JSON true must not pass as room 1.
        return (isinstance(value, int) and not isinstance(value, bool)
                and self.low <= value <= self.high)

    def __str__(self) -> str:
        return f"[{_bound(self.low)}, {_bound(self.high)}]"

    def check(self, value: Any, field: str = "bootstrap_room") -> int:
        """``value`` when it is an integer in the range; ValueError naming ``field`` and the
        range otherwise."""
        if value not in self:
            raise ValueError(f"{field} must be an integer in {self}, got {value!r}")
        return value  # type: ignore[no-any-return]

    def draw(self) -> int:
        """A room uniform in the range, from the OS's CSPRNG (rooms must not be predictable).
        One syscall per call: the router's data path draws in batches instead (router.rooms)."""
        return self.low + secrets.randbelow(self.high - self.low + 1)


ROOMS = RoomRange(0, 2**63 - 1)
"""What SGLang accepts, and so what every server of ours accepts."""

ROUTER_ROOMS = RoomRange(1, 2**63 - 1)
"""What the router draws (0 is left out: some engines treat it as unset), and so what our PD
workers take: their KV transfer refuses room 0."""
