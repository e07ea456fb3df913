"""Bootstrap rooms are echoed to clients, so they must not be predictable: they come from the
OS's CSPRNG, never from the router's seeded ``random.Random`` (a Mersenne Twister's next draws
follow from a few hundred past ones)."""
from __future__ import annotations

import os
import random
from typing import Any

from router.rooms import MAX_ROOM, new_room


def _mt_rooms(seed: int, n: int) -> list[int]:
    """The rooms a router drawing from ``random.Random(seed)`` would make (uniform in
    [1, 2^63-1], as ``randint`` draws)."""
    rng = random.Random(seed)
    return [rng.randint(1, MAX_ROOM) for _ in range(n)]


async def test_rooms_do_not_follow_the_routers_rng(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    a, b = await make_router([p], [d]), await make_router([p], [d])
    rooms: list[list[int]] = []
    for client in (a, b):
        # Knowing (or fixing) the router's own rng must tell nothing about its rooms.
        client.app.state.rng = random.Random(7)
        before = len(d.bodies)
        for i in range(32):
            assert (await client.post("/generate", json={"text": f"r{i}"})).status == 200
        rooms.append([body["bootstrap_room"] for body in d.bodies[before:]])
    assert rooms[0] != rooms[1]
    predicted = set(_mt_rooms(7, 64))
    assert not predicted & set(rooms[0] + rooms[1])


async def test_rooms_are_spread_over_the_whole_range(stubs: Any, make_router: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await make_router([p], [d])
    assert (await client.post("/generate", json={"text": ["x"] * 64})).status == 200
    rooms = d.bodies[0]["bootstrap_room"]
    assert len(set(rooms)) == 64 and all(1 <= r <= MAX_ROOM for r in rooms)
    # Each fails with probability 2^-64 for uniform draws.
    assert max(rooms) >= 2**62 and min(rooms) < 2**62


def test_a_forked_child_draws_rooms_of_its_own() -> None:
    """Rooms are drawn ahead in batches: a child must not inherit (and repeat) its parent's."""
    new_room()  # the parent now holds a batch of rooms drawn ahead
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next rooms, to the parent, then out at once
        os.write(write, b"%d %d" % (new_room(), new_room()))
        os._exit(0)
    os.close(write)
    child = {int(x) for x in os.read(read, 100).split()}
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 2 and not child & {new_room(), new_room()}
