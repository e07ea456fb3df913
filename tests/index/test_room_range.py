"""The one bootstrap room range (index/rooms.py) and its users' agreement on it."""
from __future__ import annotations

import pytest

from index.rooms import ROOMS, ROUTER_ROOMS, RoomRange


def test_bounds_are_sglangs_and_the_routers() -> None:
    assert (ROOMS.low, ROOMS.high) == (0, 2**63 - 1)
    assert (ROUTER_ROOMS.low, ROUTER_ROOMS.high) == (1, 2**63 - 1)
    assert 0 in ROOMS and 2**63 - 1 in ROOMS
    assert -1 not in ROOMS and 2**63 not in ROOMS and 2**64 - 1 not in ROOMS
    assert 0 not in ROUTER_ROOMS and 1 in ROUTER_ROOMS and 2**63 - 1 in ROUTER_ROOMS


@pytest.mark.parametrize("value", [True, False, 1.0, "1", None, [1], 2**63, -1])
def test_check_refuses_what_is_not_an_int_in_range(value: object) -> None:
    with pytest.raises(ValueError, match=r"^bootstrap_room must be an integer in \[0, 2\^63-1\]"):
        ROOMS.check(value)
    assert value not in ROOMS


def test_check_names_the_field_and_returns_the_value() -> None:
    assert ROOMS.check(0) == 0 and ROUTER_ROOMS.check(2**63 - 1, "room") == 2**63 - 1
    with pytest.raises(ValueError, match=r"^bootstrap_rooms\[\] must be an integer in \[1, "
                                         r"2\^63-1\], got 0$"):
        ROUTER_ROOMS.check(0, "bootstrap_rooms[]")


def test_draw_stays_in_range() -> None:
    assert all(v in RoomRange(5, 7) for v in (RoomRange(5, 7).draw() for _ in range(100)))
    assert {RoomRange(3, 3).draw() for _ in range(5)} == {3}
    assert ROUTER_ROOMS.draw() in ROUTER_ROOMS


def test_an_empty_or_negative_range_is_refused() -> None:
    for low, high in ((2, 1), (-1, 5)):
        with pytest.raises(ValueError, match="empty or negative"):
            RoomRange(low, high)


def test_every_user_takes_the_bound_from_here() -> None:
    from router.rooms import MAX_ROOM
    assert MAX_ROOM == ROUTER_ROOMS.high
