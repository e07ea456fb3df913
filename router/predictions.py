"""The router's predictions: blocks recently routed to each instance, counted as held there
until the index shows them (``router.kv_aware`` says when they count)."""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

from index.table import BlockTable


class Prediction:
    """Blocks recently routed to each instance, forgotten after ``ttl`` seconds or when settled.

    Per instance: a queue of routed prompts ``(time, seq, hashes)`` in routing order and
    ``{hash: seq of the latest add}``; a block leaves the table when the newest entry that added
    it leaves. Layout chosen for the garbage collector: dicts of ints and tuples of ints only, so
    CPython stops tracking them and a full collection does not walk them.
    """

    def __init__(self, ttl: float = 120.0, max_blocks: int = 1_000_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.max_blocks = max_blocks
        self._clock = clock
        self.table = BlockTable()
        self._added: dict[str, dict[int, int]] = {}
        self._queues: dict[str, deque[tuple[float, int, tuple[int, ...]]]] = {}
        self._count = 0
        self._oldest = math.inf
        """At most the time of the oldest entry of any queue (entries leave only from the
        front and new queues lower it), so that expire() can tell it has nothing to do."""
        self._held = 0
        """Hashes held by queue entries, all entries together: a same-prefix stream of
        requests adds entries without adding blocks, so ``max_blocks`` alone would not bound
        the memory (2 KB per entry for a 50-block prompt)."""
        self._seq = 0

    def __len__(self) -> int:
        return self._count

    def add(self, instance: str, hashes: Sequence[int]) -> int:
        """Record ``hashes`` as routed to ``instance``; returns the entry's sequence number."""
        if not hashes:
            self._seq += 1
            return self._seq
        now = self._clock()
        self.expire(now)
        queue = self._queues.get(instance)
        if queue:
            last = queue[-1]
            if last[2][-1] == hashes[-1] and len(last[2]) == len(hashes):
                # The same prompt again (a chain's last hash stands for the whole chain, as
                # everywhere in the index): its newest entry already holds every block with
                # the newest sequence number, so only its time moves. A hot prompt then
                # costs neither a table write nor a queue entry per request.
                queue[-1] = (now, last[1], last[2])
                return last[1]
        self._seq += 1
        added = self._added.get(instance)
        if added is None:
            added = self._added[instance] = {}
        before = len(added)
        added.update(dict.fromkeys(hashes, self._seq))
        if len(added) != before:
            # ``added`` holds exactly the instance's blocks in the table: a prompt routed there
            # again (the usual case) adds nothing to it.
            self.table.apply_add(instance, hashes)
            self._count += len(added) - before
        if not queue:
            if queue is None:
                queue = self._queues[instance] = deque()
            self._oldest = min(self._oldest, now)
        entry = tuple(hashes)
        queue.append((now, self._seq, entry))
        self._held += len(entry)
        while self._count > self.max_blocks or self._held > 2 * self.max_blocks:
            oldest = min(self._queues, key=lambda i: self._queues[i][0][1])
            self._pop(oldest)
        return self._seq

    def expire(self, now: float | None = None) -> None:
        """Drop every entry older than ``ttl``."""
        cutoff = (self._clock() if now is None else now) - self.ttl
        if cutoff < self._oldest:
            return  # nothing is that old: the usual case, twice per routed request
        queues = self._queues
        for instance in [i for i, q in queues.items() if q[0][0] <= cutoff]:
            self.settle(instance, before=cutoff)
        self._oldest = min((q[0][0] for q in queues.values()), default=math.inf)

    def settle(self, instance: str, before: float | None = None,
               upto_seq: int | None = None) -> None:
        """Drop the entries of ``instance`` routed at or before time ``before``, and those up to
        sequence number ``upto_seq``."""
        queue = self._queues.get(instance)
        while queue and ((before is not None and queue[0][0] <= before)
                         or (upto_seq is not None and queue[0][1] <= upto_seq)):
            self._pop(instance)
            queue = self._queues.get(instance)

    def _pop(self, instance: str) -> None:
        queue = self._queues[instance]
        _, seq, hashes = queue.popleft()
        self._held -= len(hashes)
        added = self._added[instance]
        gone = []
        for h in hashes:
            a = added.get(h)
            # A later add refreshed this block: its own entry will drop it.
            if a is not None and a <= seq:
                del added[h]
                gone.append(h)
        if gone:
            self._count -= len(gone)
            self.table.apply_remove(instance, gone)
        if not queue:
            del self._queues[instance]
            self._added.pop(instance, None)

    def first_seq(self, instance: str) -> int | None:
        """Sequence number of ``instance``'s oldest live entry (None: it has none)."""
        queue = self._queues.get(instance)
        return queue[0][1] if queue else None

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        self.expire()
        return self.table.lookup(hashes)

    def forget(self, instance: str) -> None:
        self.table.clear_instance(instance)
        self._count -= len(self._added.pop(instance, {}))
        self._held -= sum(len(e[2]) for e in self._queues.pop(instance, ()))
