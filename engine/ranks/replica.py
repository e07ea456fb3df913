"""Lockstep replication of the scheduler across the TP ranks of one DP group (SGLang-style).

Every TP rank runs an identical ``Scheduler`` over its own KV-head shard. The leader wraps its
scheduler in :class:`ReplicatedScheduler`: each call that changes scheduler state is broadcast to
the group first, then run locally, all from the engine thread; followers run the same calls in the
same order (:func:`follow`). Allocation is deterministic, so every rank holds a request's KV in the
same page ids, and the per-layer all-gather inside ``forward`` gives every rank identical logits.
Transfer commands (send these pages, receive this room) travel in the same ordered stream and are
handed to the follower's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.ranks.dist import Dist
from engine.sampling import make_generator
from engine.scheduler import Request, RequestOutput, Scheduler

logger = logging.getLogger(__name__)

STOP = ("stop",)


class ReplicatedScheduler:
    """The leader's scheduler proxy: mutations are broadcast, reads go to the local scheduler."""

    def __init__(self, scheduler: Scheduler, dist: Dist) -> None:
        self._sched = scheduler
        self._dist = dist
        self._replicas = dist.info.tp_size > 1
        self.prefilled: set[str] = set()
        """Requests whose reserved pages ``add_prefilled`` handed to the scheduler (the decode
        uses it to tell, in the engine thread, who owns a reservation after a cancellation)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)

    def _cast(self, op: tuple[Any, ...]) -> None:
        if self._replicas:
            self._dist.group_broadcast(op)

    @staticmethod
    def _pin_seed(req: Request) -> None:
        # ranks sample independently: an unseeded request must draw the same stream everywhere
        if req.params.seed is None and not req.params.greedy:
            req.params = replace(req.params, seed=secrets.randbits(63))
            req.gen = make_generator(req.params.seed)

    def add(self, req: Request) -> None:
        self._pin_seed(req)
        self._cast(("add", req.rid, req.prompt, req.params, req.hold_pages))
        self._sched.add(req)

    def add_prefilled(self, req: Request, table: list[int], first_token: int) -> RequestOutput:
        self._pin_seed(req)
        self._cast(("add_prefilled", req.rid, req.prompt, req.params, list(table), first_token))
        out = self._sched.add_prefilled(req, table, first_token)
        self.prefilled.add(req.rid)
        return out

    def settle_reservation(self, rid: str, pages: list[int]) -> None:
        """End of a decode request: free its reservation unless the scheduler took it over."""
        if rid in self.prefilled:
            self.prefilled.discard(rid)
        else:
            self.release_reserved(pages)

    def step(self) -> list[RequestOutput]:
        self._cast(("step",))
        return self._sched.step()

    def abort(self, rid: str) -> RequestOutput | None:
        self._cast(("abort", rid))
        return self._sched.abort(rid)

    def release_held(self, rid: str) -> bool:
        self._cast(("release_held", rid))
        return self._sched.release_held(rid)

    def reserve(self, prompt_len: int, max_new_tokens: int) -> list[int] | None:
        self._cast(("reserve", prompt_len, max_new_tokens))
        return self._sched.reserve(prompt_len, max_new_tokens)

    def release_reserved(self, pages: list[int]) -> None:
        self._cast(("release_reserved", list(pages)))
        self._sched.release_reserved(pages)

    def flush_cache(self) -> int | None:
        self._cast(("flush_cache",))
        return self._sched.flush_cache()

    def transfer(self, op: tuple[Any, ...]) -> None:
        """Hand a transfer command to the followers, ordered with the scheduler calls."""
        self._cast(("transfer", op))

    def stop(self) -> None:
        self._cast(STOP)


def follow(sched: Scheduler, dist: Dist, on_transfer: Callable[[tuple[Any, ...]], None]) -> None:
    """A follower's engine thread: run the leader's calls until it says stop (blocking)."""
    while True:
        op = dist.group_broadcast(None)
        kind = op[0]
        try:
            if kind == "stop":
                return
            if kind == "step":
                sched.step()
                sched.cache.drain_events()  # the leader publishes; keep the list bounded
            elif kind == "add":
                _, rid, prompt, params, hold = op
                sched.add(Request(rid, prompt, params, hold_pages=hold))
            elif kind == "add_prefilled":
                _, rid, prompt, params, table, first = op
                sched.add_prefilled(Request(rid, prompt, params), table, first)
            elif kind == "abort":
                sched.abort(op[1])
            elif kind == "release_held":
                sched.release_held(op[1])
            elif kind == "reserve":
                sched.reserve(op[1], op[2])
            elif kind == "release_reserved":
                sched.release_reserved(op[1])
            elif kind == "flush_cache":
                sched.flush_cache()
                sched.cache.drain_events()
            elif kind == "transfer":
                on_transfer(op[1])
            else:
                logger.error("unknown replicated call %r", kind)
        except Exception:  # the leader hit the same error; stay in lockstep
            logger.debug("replicated %s raised", kind, exc_info=True)


#: Transfer commands the engine thread waits for before it runs the next replicated call.
#: The leader casts an abort just before the call that gives the room's pages back (or reuses
#: them); waiting makes this rank's sender or receiver stop touching them first.
WAITED_OPS = frozenset({"abort"})
#: An abort handler does no I/O (it fails the room and queues the notices); this only bounds a
#: wedged event loop, so that the engine thread logs it and stays in lockstep.
WAITED_OP_TIMEOUT_S = 30.0


def loop_handoff(loop: asyncio.AbstractEventLoop,
                 handler: Callable[[tuple[Any, ...]], Any]) -> Callable[[tuple[Any, ...]], None]:
    """``on_transfer`` for :func:`follow`: run ``handler(op)`` (a coroutine function) as a task
    in the follower's event loop; for an op in :data:`WAITED_OPS`, return once it ran. Tasks
    start in the order of their ops, so an abort runs after the send or receive it ends."""
    def hand(op: tuple[Any, ...]) -> None:
        if op[0] not in WAITED_OPS:
            loop.call_soon_threadsafe(lambda: loop.create_task(handler(op)))
            return
        done = asyncio.run_coroutine_threadsafe(handler(op), loop)
        try:
            done.result(WAITED_OP_TIMEOUT_S)
        except Exception:  # timed out or raised: the call that follows must still run
            logger.warning("transfer %s of room %s did not finish in the event loop", op[0],
                        op[1] if len(op) > 1 else None, exc_info=True)
    return hand
