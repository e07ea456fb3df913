"""The room -> dp rank map: TTL, sweep, and the bound that evicts the oldest entries."""
from __future__ import annotations

from bootstrap.dp_rooms import DpRoomMap


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_ttl_expiry_and_sweep() -> None:
    clock = Clock()
    rooms = DpRoomMap(ttl=120, max_entries=100, clock=clock)
    rooms.register(1, 0)
    clock.now += 60
    rooms.register(2, 1)
    assert rooms.query([1, 2, 3]) == {"1": 0, "2": 1}
    clock.now += 61  # room 1 is 121 s old, room 2 is 61 s old
    assert rooms.query([1, 2]) == {"2": 1}
    assert rooms.sweep() == 1 and len(rooms) == 1
    clock.now += 60
    assert rooms.sweep() == 1 and len(rooms) == 0 and rooms.expired == 2


def test_reregistering_takes_the_last_rank_and_refreshes_the_age() -> None:
    clock = Clock()
    rooms = DpRoomMap(ttl=10, max_entries=100, clock=clock)
    rooms.register(7, 0)
    clock.now += 8
    rooms.register(7, 3)
    clock.now += 8
    assert rooms.sweep() == 0
    assert rooms.query([7]) == {"7": 3}


def test_bound_evicts_the_oldest() -> None:
    rooms = DpRoomMap(ttl=120, max_entries=1000)
    for room in range(5000):
        rooms.register(room, room % 4)
    assert len(rooms) == 1000 and rooms.evicted == 4000
    assert rooms.query([0, 3999]) == {}
    assert rooms.query([4000, 4999]) == {"4000": 0, "4999": 3}
