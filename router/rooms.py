"""Bootstrap rooms: uniform in [1, 2^63-1], from the OS's CSPRNG.

Rooms are echoed to clients (``meta_info``), so they must not be predictable: a Mersenne
Twister (``random.Random``) gives its next draws away after ~700 past ones, which would let a
client predict, and pre-empt, other requests' rooms. ``secrets.randbelow`` costs a syscall per
call (~4 us); the rooms are drawn from one ``os.urandom`` read per ``_BATCH`` instead, so the
data path pays a list pop.
"""
from __future__ import annotations

import os
from array import array

from index.rooms import ROUTER_ROOMS

MAX_ROOM = ROUTER_ROOMS.high
_BATCH = 1024
_rooms: list[int] = []


def new_room() -> int:
    """A bootstrap room, uniform in [1, 2^63-1] (0 is avoided: some engines treat it as unset)."""
    if not _rooms:
        _refill()
    return _rooms.pop()


def _refill() -> None:
    words = array("Q", os.urandom(8 * _BATCH))
    # 63 random bits each; the one value >= MAX_ROOM is dropped, so the rest stay uniform.
    # (The shift and the +1 assume ROUTER_ROOMS is [1, 2^63-1]; tests/router/test_rooms.py.)
    _rooms.extend((w >> 1) + 1 for w in words if w >> 1 < MAX_ROOM)


# A forked child must not hand out the very rooms its parent will.
os.register_at_fork(after_in_child=_rooms.clear)
