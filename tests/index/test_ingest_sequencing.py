"""Hypothesis state machine for KV-event sequencing (``InstanceIngestor``, no sockets).

The model is an engine process (its prefix cache, its sequence counter, its replay buffer) and
the transport between it and the ingestor: batches in flight can be delivered or lost; a gap
may start a replay that the ROUTER serves step by step while live traffic keeps arriving (and is
held back), ends with its end marker or times out, and may miss its start when the buffer has
moved on (partial replay); the engine may clear its cache (``AllBlocksCleared``), also while a
replay runs, and restart (a new process: empty cache, counter from 0, its old ROUTER gone).

Invariant, whenever nothing is in flight and no replay runs: while ``synced`` the index holds
exactly our own hashes of what the engine held as of the newest batch that reached the ingestor
(lost batches at the very end of a stream, or of a process, cannot be noticed by anyone);
otherwise it never claims a block the engine did not hold then. One other thing no consumer can
notice is left out: a restarted engine whose first batch to arrive has a sequence number past
everything seen from the old one.
"""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from hypothesis import assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kv_sim import SimEngine, block_key, branching_prompts, own, stamped
from memory_index import MemoryBlockIndex

from index.events.ingest import InstanceIngestor, ReplayRequest
from index.events.types import AllBlocksCleared, KVEvent, KVEventBatch

BS = 4
BUFFER = 5
"""Batches the simulated replay buffer keeps (vLLM keeps 10,000): small, so replays can miss
their start."""
PROMPTS = branching_prompts(BS)
OWN = [own(p, BS) for p in PROMPTS]

Key = tuple[int, int]  # (prompt, block), the first prompt that has this token prefix
Sent = tuple[int, KVEventBatch, frozenset[Key]]  # (seq, batch, what the engine held after it)


def key(p: int, b: int) -> Key:
    return block_key(PROMPTS, BS, p, b)


@dataclass
class Replay:
    run: int
    """The engine process whose ROUTER serves it: a restart ends it (it can only time out)."""
    cursor: int
    """The next sequence number the ROUTER would send."""


class SequencingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.idx = MemoryBlockIndex()
        self.ing: InstanceIngestor | None = None
        self.run = 0
        self.eng = SimEngine(BS, "signed", salt=b"run0")
        self.next_seq = 0
        self.held: set[Key] = set()
        self.buffer: deque[Sent] = deque(maxlen=BUFFER)
        self.in_flight: deque[Sent] = deque()
        self.replay: Replay | None = None
        self.delivered_this_run = False
        # What the engine held as of the newest batch delivered: (run, seq, blocks).
        self.known: tuple[int, int, frozenset[Key]] = (0, -1, frozenset())

    def teardown(self) -> None:
        self.loop.close()

    @initialize(replay=st.booleans())
    def make_ingestor(self, replay: bool) -> None:
        self.ing = InstanceIngestor(self.idx, "p0", block_size=BS, replay=replay)

    # --- the engine -------------------------------------------------------------------------

    def publish(self, *events: KVEvent) -> None:
        """Send a batch of what just changed in ``held``."""
        seq = self.next_seq
        self.next_seq += 1
        # A timestamp per batch, as a publisher stamps them: a replayed batch and its live copy
        # carry the same one, a restarted engine's batch of the same number another.
        batch = stamped(self.run * 1000.0 + seq, *events)
        sent = (seq, batch, frozenset(self.held))
        self.buffer.append(sent)
        self.in_flight.append(sent)

    @rule(p=st.integers(0, 2), start=st.integers(0, 5), n=st.integers(1, 3))
    def store(self, p: int, start: int, n: int) -> None:
        if start and key(p, start - 1) not in self.held:
            start = 0  # an engine chains new blocks to a block it holds, or starts a sequence
        end = min(6, start + n)
        self.held.update(key(p, b) for b in range(start, end))
        self.publish(self.eng.vllm_store(PROMPTS[p][:end * BS], start_block=start))

    @rule(p=st.integers(0, 2), blocks=st.lists(st.integers(0, 5), min_size=1, max_size=3))
    def evict(self, p: int, blocks: list[int]) -> None:
        blocks = [b for b in blocks if key(p, b) in self.held]
        if blocks:
            self.held.difference_update(key(p, b) for b in blocks)
            self.publish(self.eng.remove(PROMPTS[p], blocks))

    @rule()
    def clear(self) -> None:
        self.held.clear()
        self.publish(AllBlocksCleared())

    @rule()
    def restart(self) -> None:
        """A new engine process: its old PUB and ROUTER are gone with what they had."""
        self.run += 1
        self.eng = SimEngine(BS, "signed", salt=b"run%d" % self.run)
        self.next_seq = 0
        self.held.clear()
        self.buffer.clear()
        self.in_flight.clear()
        self.delivered_this_run = False

    # --- the transport ----------------------------------------------------------------------

    def call(self, coro):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(coro)

    def arrived(self, seq: int, held: frozenset[Key]) -> None:
        run, last, _ = self.known
        if run != self.run or seq > last:
            self.known = (self.run, seq, held)

    @precondition(lambda self: self.in_flight)
    @rule()
    def deliver(self) -> None:
        assert self.ing is not None
        seq, batch, held = self.in_flight.popleft()
        if not self.delivered_this_run and seq:
            last = self.ing.stats.last_seq
            assume(last is not None and seq <= last)  # see the module docstring
        self.delivered_this_run = True
        self.arrived(seq, held)
        action = self.call(self.ing.on_batch(seq, batch))
        if isinstance(action, ReplayRequest):
            assert self.replay is None, "a second replay while one runs"
            self.replay = Replay(self.run, action.start_seq)

    @precondition(lambda self: self.in_flight)
    @rule()
    def lose(self) -> None:
        self.in_flight.popleft()

    def _replayable(self) -> list[Sent]:
        if self.replay is None or self.replay.run != self.run:
            return []
        return [sent for sent in self.buffer if sent[0] >= self.replay.cursor]

    @precondition(lambda self: self._replayable())
    @rule()
    def replay_step(self) -> None:
        assert self.ing is not None and self.replay is not None
        seq, batch, held = self._replayable()[0]
        self.replay.cursor = seq + 1
        self.arrived(seq, held)
        assert self.call(self.ing.on_batch(seq, batch, replayed=True)) is None

    @precondition(lambda self: self.replay is not None and self.replay.run == self.run
                  and not self._replayable())
    @rule()
    def replay_end(self) -> None:
        assert self.ing is not None
        self.replay = None
        self.call(self.ing.replay_finished(True))

    @precondition(lambda self: self.replay is not None)
    @rule()
    def replay_timeout(self) -> None:
        assert self.ing is not None
        self.replay = None
        self.call(self.ing.replay_finished(False))

    @rule()
    def drain(self) -> None:
        """Everything in flight arrives and any replay completes: the invariant gets checked."""
        while self.in_flight or self.replay is not None:
            if self.replay is not None:
                if self._replayable():
                    self.replay_step()
                elif self.replay.run == self.run:
                    self.replay_end()
                else:
                    self.replay_timeout()
            else:
                self.deliver()

    # --- the invariant ----------------------------------------------------------------------

    @invariant()
    def index_matches_the_engine(self) -> None:
        if self.ing is None or self.in_flight or self.replay is not None:
            return
        got = self.idx.blocks("p0")
        want = {OWN[p][b] for p, b in self.known[2]}
        if self.ing.state == "synced":
            assert got == want, (f"synced, but the index differs from the engine: "
                                 f"extra {len(got - want)}, missing {len(want - got)}")
        else:
            assert self.ing.state == "resyncing"
            assert got <= want, f"the index claims {len(got - want)} blocks the engine dropped"


TestSequencingMachine = SequencingMachine.TestCase
TestSequencingMachine.settings = settings(max_examples=300, stateful_step_count=40,
                                          deadline=None)
