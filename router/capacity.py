"""Per-worker admission: the router puts no more on a worker than the worker says it holds.

Why: a burst of long prompts forwarded at once fills both pools of a disaggregated pair (the
prefills hold KV for requests whose decodes have no pages to receive it, and the decodes hold
pages for requests still waiting on a prefill) until neither moves. Held back at the router, a
burst waits in one FIFO queue, and past that queue is told to come back later (429 with
``Retry-After``), instead of piling up inside both pools.

**What a worker states** (SGLang's ``/server_info`` names): ``max_running_requests`` and
``max_total_num_tokens`` (its KV pool in tokens) with ``page_size``. An etcd worker states them
in its instance record; a static or admin worker in its ``/server_info`` (asked once by the
health checks). A worker that states neither is not bounded here (as before this module).

**What the router counts per worker** (its own requests only, released when their upstream
call completes): requests in flight (``Worker.load``) and the KV pages they need, per prompt
``ceil(prompt / page_size)`` at a prefill and ``ceil((prompt + max_new) / page_size)`` at a
decode (``max_new``: the request's ``max_new_tokens`` / ``max_tokens``, else
``DEFAULT_NEW_TOKENS``). A worker has room for a request while both stay within what it
stated; a worker holding nothing of the router's always has room, so a request larger than a
whole pool reaches the engine, which answers it with its own error instead of it waiting here
for ever.

**The queue.** When every available worker of a role is at its bound, the request waits in a
FIFO queue (``worker_queue_size``): only its head tries to select, and it is woken when a
worker's count drops (never polled). Past ``worker_queue_timeout`` seconds it gets a 408; with
the queue full, or so long that at the rate the workers have been finishing requests it would
not drain within half that timeout (``ADMIT_FRACTION``), a 429 at once. Both carry
``Retry-After``: the seconds in which, at that rate, the queue ahead would have drained.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from router.errors import Overloaded, RouterError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_NEW_TOKENS = 128
"""Tokens a request asking for no maximum is counted to generate (SGLang's default
``max_new_tokens``)."""
RATE_WINDOW = 5.0
"""Seconds over which the rate of finished requests (for ``Retry-After``) is averaged."""
ADMIT_FRACTION = 0.5
"""A request joins the queue only while, at the recent rate, it would reach a worker within
this share of the queue timeout: the rate is an estimate, and one that turns out optimistic
would otherwise leave requests to time out in the queue (a 408 after waiting for nothing)
where a 429 at once would have sent their clients back later (300 closed-loop clients on 2
prefills and 1 decode: 18 of 892 timed out with the whole timeout as the bound)."""


@dataclass(frozen=True)
class Bound:
    """What one worker says it holds at once (None: it does not say)."""

    max_running: int | None
    pages: int | None
    """KV pool pages (``max_total_num_tokens // page_size``)."""
    page_size: int


def _positive(doc: dict[str, Any], name: str) -> int | None:
    v = doc.get(name)
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def stated_bound(doc: Any) -> Bound | None:
    """The bound a record or ``/server_info`` states; None when it states neither limit."""
    if not isinstance(doc, dict):
        return None
    running = _positive(doc, "max_running_requests")
    tokens = _positive(doc, "max_total_num_tokens")
    page_size = _positive(doc, "page_size") or 1
    pages = tokens // page_size if tokens is not None else None
    if running is None and not pages:
        return None
    return Bound(running, pages or None, page_size)


@dataclass(frozen=True)
class Need:
    """The tokens one request occupies: its prompts' lengths and the tokens it may generate."""

    prompts: tuple[int, ...]
    new_tokens: int

    def pages(self, page_size: int, decode: bool) -> int:
        extra = self.new_tokens if decode else 0
        return sum(-(-(n + extra) // page_size) for n in self.prompts)


def request_need(body: dict[str, Any], prompts: Sequence[Sequence[int]]) -> Need:
    """What a parsed request needs (a text prompt the router could not tokenize counts 0
    prompt tokens: only its request and its new tokens are counted)."""
    new = body.get("max_tokens", body.get("max_completion_tokens"))
    sp = body.get("sampling_params")
    if isinstance(sp, dict) and sp.get("max_new_tokens") is not None:
        new = sp["max_new_tokens"]
    if not isinstance(new, int) or isinstance(new, bool) or new < 0:
        new = DEFAULT_NEW_TOKENS  # the parser refused bad values; None: the default
    return Need(tuple(len(p) for p in prompts), new)


class NoRoom(RouterError):
    """Every available worker of ``role`` is at its bound (the request waits; a 503 only if
    it ever escaped the queue)."""

    status = 503

    def __init__(self, role: str) -> None:
        super().__init__(f"every available {role} worker is at the capacity it states")
        self.role = role


class Capacity:
    """The stated bounds, the pages the router's requests hold, and the queue of those waiting."""

    def __init__(self, enabled: bool, queue_size: int, queue_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self._clock = clock
        self.bounds: dict[str, Bound] = {}
        """By instance id: what each worker stated (record first, then /server_info)."""
        self._from_record: set[str] = set()
        self.pages: dict[str, int] = {}
        """By instance id: pages held by the router's requests in flight there."""
        self._waiters: deque[asyncio.Event] = deque()
        self._rate = 0.0
        self._rate_at = clock()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    # --- what workers state -----------------------------------------------------------------

    def on_worker(self, event: str, worker: Any) -> None:
        """Pools listener: a record states the bound (it names this very process)."""
        iid = worker.instance_id
        if event == "leave":
            self.bounds.pop(iid, None)
            self._from_record.discard(iid)
            self._wake()  # the head learns at once if no worker is left (503, not a wait)
            return
        bound = stated_bound(worker.record)
        if bound is not None:
            self._learn(iid, bound, "record")
            self._from_record.add(iid)
        elif iid in self._from_record or event == "moved":
            self.bounds.pop(iid, None)  # another process now: it has yet to say
            self._from_record.discard(iid)
        self._wake()  # a worker that joined may have room for the head of the queue

    def on_info(self, worker: Any, info: Any) -> None:
        """Health checks' listener: a static worker's /server_info states the bound."""
        iid = worker.instance_id
        if iid in self._from_record:
            return
        bound = stated_bound(info)
        if bound is not None:
            self._learn(iid, bound, "/server_info")
            self._wake()

    def _learn(self, iid: str, bound: Bound, source: str) -> None:
        if self.bounds.get(iid) != bound:
            logger.info("worker %s holds at most %s requests and %s KV pages of %d tokens (its %s)",
                        iid, bound.max_running, bound.pages, bound.page_size, source)
            self.bounds[iid] = bound

    # --- selection --------------------------------------------------------------------------

    def with_room(self, workers: list[Any], need: Need, decode: bool, role: str) -> list[Any]:
        """The ``workers`` with room for ``need``; NoRoom when none has."""
        bounds = self.bounds
        if not self.enabled or not bounds:
            return workers
        room = [w for w in workers if self._fits(w, bounds.get(w.instance_id), need, decode)]
        if not room:
            raise NoRoom(role)
        return room

    def _fits(self, worker: Any, bound: Bound | None, need: Need, decode: bool) -> bool:
        if bound is None or worker.load == 0:
            return True
        if bound.max_running is not None and worker.load >= bound.max_running:
            return False
        if bound.pages is None:
            return True
        held = self.pages.get(worker.instance_id, 0)
        return held + need.pages(bound.page_size, decode) <= bound.pages

    def take(self, worker: Any, need: Need, decode: bool) -> int:
        """Count ``need``'s pages as held at ``worker``; the pages to ``give`` back."""
        bound = self.bounds.get(worker.instance_id)
        if bound is None or bound.pages is None:
            return 0
        pages = need.pages(bound.page_size, decode)
        self.pages[worker.instance_id] = self.pages.get(worker.instance_id, 0) + pages
        return pages

    def give(self, worker: Any, pages: int, finished: bool = False) -> None:
        """A request's call to ``worker`` completed (``Worker.load`` already dropped): its
        pages are free; the head of the queue may fit now. ``finished``: the request is done
        (counted for ``Retry-After``)."""
        if not self.enabled:
            return  # nothing held, no one queued, no rate read: nothing to count per request
        if pages:
            iid = worker.instance_id
            left = self.pages.get(iid, 0) - pages
            if left > 0:
                self.pages[iid] = left
            else:
                self.pages.pop(iid, None)
        if finished:
            now = self._clock()
            self._rate = self._rate * math.exp(-(now - self._rate_at) / RATE_WINDOW) \
                + 1 / RATE_WINDOW
            self._rate_at = now
        self._wake()

    def _wake(self) -> None:
        if self._waiters:
            self._waiters[0].set()

    # --- the queue --------------------------------------------------------------------------

    def expected_wait(self) -> float | None:
        """Seconds a request queued now would wait, at the rate requests finished lately
        (None: none finished within ``RATE_WINDOW``, no rate to go by: after a quiet spell a
        burst queues rather than being judged by the trickle before it)."""
        idle = self._clock() - self._rate_at
        if idle > RATE_WINDOW or self._rate <= 0:
            return None
        return (self.queued + 1) / (self._rate * math.exp(-idle / RATE_WINDOW))

    def retry_after(self) -> int:
        """Seconds until the queue ahead would have drained, within [1, the queue timeout]."""
        wait = self.expected_wait()
        if wait is None:
            return 1
        return max(1, min(math.ceil(wait), math.ceil(self.queue_timeout)))

    async def admit(self, select: Callable[[], T]) -> T:
        """``select()`` once a worker has room: at once when no one waits, else in turn.
        ``select`` raises NoRoom when it found none with room (and NoWorkers etc. as usual)."""
        if not self._waiters:
            try:
                return select()
            except NoRoom:
                pass
        if len(self._waiters) >= self.queue_size:
            raise Overloaded(429, f"every worker is at the capacity it states and "
                             f"{self.queued} requests wait for one (router --worker-queue-size "
                             f"{self.queue_size}); retry later", self.retry_after())
        wait = self.expected_wait()
        if wait is not None and wait > self.queue_timeout * ADMIT_FRACTION:
            # It would only time out in the queue: told now, it can come back when there is room.
            raise Overloaded(429, f"every worker is at the capacity it states and the "
                             f"{self.queued} requests waiting would take about {wait:.0f} s to "
                             f"reach one, past half of router --worker-queue-timeout-secs "
                             f"{self.queue_timeout:g}; retry later", self.retry_after())
        turn = asyncio.Event()
        self._waiters.append(turn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.queue_timeout
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(turn.wait(), left)
                except TimeoutError:
                    break
                turn.clear()
                try:
                    chosen = select()
                except NoRoom:
                    continue
                return chosen
        finally:
            # Whether it got a worker, timed out, failed or was cancelled: the next in line
            # tries now (there may be room for it, or room this one could not use).
            first = self._waiters[0] is turn
            self._waiters.remove(turn)
            if first:
                self._wake()
        raise Overloaded(408, f"no worker had room within {self.queue_timeout:g} s (router "
                         "--worker-queue-timeout-secs; the workers' stated "
                         "max_running_requests and KV pages bound what each takes)",
                         self.retry_after())
