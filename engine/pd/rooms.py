"""Per-room evidence on the decode side: the furthest stage a room reached, and why it failed.

A control plane that "connects" proves nothing by itself; only KV that arrived for the right room
and passed validation counts. So the decode records, for every ``bootstrap_room``, each stage it
reached (registered -> resolved topology -> resolved ranks -> connected -> verified -> consumed)
with timestamps, and a failure names the stage it happened in and the rank involved. Finished rooms
stay readable (``GET /debug/rooms/{room}``) for a while, bounded by count and age.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

STAGES = ("registered", "resolved_topology", "resolved_ranks", "connected", "verified",
          "consumed")


@dataclass
class RoomRecord:
    room: int
    rid: str
    bootstrap: str
    stage: str = "registered"
    stages: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, Any] = field(default_factory=dict)
    state: str = "in_flight"
    """``in_flight``, ``done`` or ``failed``."""
    error: dict[str, Any] | None = None
    ended: float | None = None

    def reach(self, stage: str, **info: Any) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown room stage {stage!r}")
        self.stage = stage
        self.stages[stage] = time.time()
        self.ranks.update(info)

    def doc(self) -> dict[str, Any]:
        return {"room": self.room, "rid": self.rid, "bootstrap": self.bootstrap,
                "stage": self.stage, "state": self.state,
                "stages": [{"stage": s, "at": t} for s, t in self.stages.items()],
                "ranks": self.ranks, "error": self.error}


class RoomLog:
    """Rooms in flight plus the last ``keep`` finished ones (each kept at most ``ttl_s``)."""

    def __init__(self, keep: int = 4096, ttl_s: float = 600.0) -> None:
        if keep < 1 or ttl_s <= 0:
            raise ValueError("room log needs keep >= 1 and ttl_s > 0")
        self.keep, self.ttl_s = keep, ttl_s
        self.active: dict[int, RoomRecord] = {}
        self.finished: OrderedDict[int, RoomRecord] = OrderedDict()

    def open(self, room: int, rid: str, bootstrap: str) -> RoomRecord:
        rec = RoomRecord(room, rid, bootstrap)
        rec.reach("registered")
        self.active[room] = rec
        return rec

    def close(self, rec: RoomRecord, *, error: dict[str, Any] | None = None) -> None:
        rec.state = "failed" if error else "done"
        rec.error = error
        rec.ended = time.time()
        self.active.pop(rec.room, None)
        self.finished[rec.room] = rec
        self.finished.move_to_end(rec.room)
        self._trim()

    def _trim(self) -> None:
        now = time.time()
        while self.finished:
            room, rec = next(iter(self.finished.items()))
            if len(self.finished) > self.keep or now - (rec.ended or now) > self.ttl_s:
                del self.finished[room]
            else:
                break

    def get(self, room: int) -> RoomRecord | None:
        self._trim()
        return self.active.get(room) or self.finished.get(room)

    def counts(self) -> dict[str, int]:
        failed = sum(1 for r in self.finished.values() if r.state == "failed")
        return {"in_flight": len(self.active), "done": len(self.finished) - failed,
                "failed": failed}
