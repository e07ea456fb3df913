"""Per-instance ingestion (no sockets): own-hash recomputation, refusals by reason, sequencing."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kv_sim import SimEngine, block_key, branching_prompts, own, stamped
from memory_index import MemoryBlockIndex

from index.events.codec import decode_payload, encode_payload
from index.events.ingest import InstanceIngestor, ReplayRequest
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from index.hashing import block_hashes, namespace_seed

BS = 4
PROMPT = list(range(100, 100 + 6 * BS))  # 6 full blocks


def wire(*events: KVEvent, encoding: str = "map") -> KVEventBatch:
    """Through the real codec, so engine hashes arrive normalised as they would off the wire."""
    return decode_payload(encode_payload(KVEventBatch(0.0, list(events)), encoding))  # type: ignore[arg-type]


def make(**kw: object) -> tuple[MemoryBlockIndex, InstanceIngestor]:
    idx = MemoryBlockIndex()
    return idx, InstanceIngestor(idx, "p0", block_size=BS, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("style", ["signed", "unsigned", "bytes"])
@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_vllm_style_batches_index_our_own_hashes(style: str, encoding: str) -> None:
    eng = SimEngine(BS, style)  # type: ignore[arg-type]
    idx, ing = make()
    # Blocks 0-2, then 3-5 chained to block 2 by the engine's parent hash.
    await ing.on_batch(0, wire(eng.vllm_store(PROMPT[:3 * BS]), encoding=encoding))
    await ing.on_batch(1, wire(eng.vllm_store(PROMPT, start_block=3), encoding=encoding))
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 6}
    assert idx.blocks("p0") == set(own(PROMPT, BS))
    assert ing.stats.applied == 2 and not ing.stats.rejected
    assert ing.stats.last_seq == 1 and ing.engine_hashes == 6
    await ing.on_batch(2, wire(eng.remove(PROMPT, [4, 5]), encoding=encoding))
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 4}
    assert ing.engine_hashes == 4


async def test_sglang_pages_with_partial_last_page() -> None:
    eng = SimEngine(BS, "signed")
    idx, ing = make()
    tokens = PROMPT[:3 * BS + 2]  # 3 full pages and a partial one
    await ing.on_batch(0, wire(*eng.sglang_store(tokens)))
    assert idx.lookup(own(tokens, BS)) == {"p0": 3}
    assert ing.stats.applied == 3
    assert ing.stats.rejected == {"block_size_mismatch": 1}


async def test_refusals_are_counted_by_reason() -> None:
    eng = SimEngine(BS)
    idx, ing = make()
    orphan = eng.vllm_store(PROMPT, start_block=2)  # its parent was never stored
    short = BlockStored([1, 2], None, PROMPT[:BS], BS)  # two hashes, one block of tokens
    other_size = BlockStored([9], None, PROMPT[:8], 8)
    await ing.on_batch(0, wire(orphan, short, other_size, BlockStored([], None, [], BS)))
    assert idx.instances() == set()
    assert ing.stats.rejected == {"unknown_parent": 1, "token_count_mismatch": 1,
                                  "block_size_mismatch": 1, "empty": 1}
    assert ing.engine_hashes == 0
    await ing.on_batch(1, wire(BlockRemoved([12345])))
    assert ing.stats.unknown_removed == 1


async def test_medium_and_lora_namespace() -> None:
    eng = SimEngine(BS)
    idx, ing = make()
    ev = eng.vllm_store(PROMPT[:2 * BS], medium="CPU_PINNED")
    lora = BlockStored([77], None, PROMPT[:BS], BS, lora_name="adapter-1")
    await ing.on_batch(0, wire(ev, lora))
    hs = own(PROMPT[:2 * BS], BS)
    assert [idx.medium("p0", h) for h in hs] == ["CPU_PINNED", "CPU_PINNED"]
    lora_h = block_hashes(PROMPT[:BS], BS, namespace_seed("adapter-1"))
    assert lora_h[0] != hs[0] and idx.lookup(lora_h) == {"p0": 1}


async def test_all_blocks_cleared_clears_and_ends_resync() -> None:
    eng = SimEngine(BS)
    idx, ing = make()
    await ing.on_batch(0, wire(eng.vllm_store(PROMPT)))
    await ing.on_batch(5, wire())  # gap, no replay: cleared, resyncing
    assert ing.state == "resyncing"
    await ing.on_batch(6, wire(eng.vllm_store(PROMPT), AllBlocksCleared(), eng.vllm_store(PROMPT[:BS])))
    assert ing.state == "synced"
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 1}
    assert ing.engine_hashes == 1


async def test_gap_without_replay_clears_and_marks_resyncing() -> None:
    eng = SimEngine(BS)
    idx, ing = make()
    await ing.on_batch(0, wire(eng.vllm_store(PROMPT[:2 * BS])))
    assert await ing.on_batch(3, wire(eng.vllm_store(PROMPT, start_block=2))) is None
    # The continuation's parent is gone with the clear: refused, and nothing stale remains.
    assert idx.instances() == set()
    assert ing.state == "resyncing"
    assert ing.stats.gaps == 1 and ing.stats.last_seq == 3
    assert ing.stats.rejected == {"unknown_parent": 1}
    other = list(range(5000, 5000 + 2 * BS))
    await ing.on_batch(4, wire(eng.vllm_store(other)))
    assert idx.lookup(own(other, BS)) == {"p0": 2}


async def test_seq_backwards_means_restart() -> None:
    eng = SimEngine(BS)
    idx, ing = make()
    for seq in range(3):
        await ing.on_batch(seq, wire(eng.vllm_store(PROMPT[:(seq + 1) * BS])))
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 3}
    await ing.on_batch(0, wire(SimEngine(BS, salt=b"run2").vllm_store(PROMPT[:BS])))
    assert ing.stats.restarts == 1
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 1}
    assert ing.engine_hashes == 1 and ing.state == "synced"


async def test_gap_with_replay_requests_and_applies_in_order() -> None:
    eng = SimEngine(BS)
    idx, ing = make(replay=True)
    batches = [wire(eng.vllm_store(PROMPT[:(i + 1) * BS], start_block=i)) for i in range(6)]
    await ing.on_batch(0, batches[0])
    assert await ing.on_batch(3, batches[3]) == ReplayRequest(1)
    assert ing.state == "replaying"
    await ing.on_batch(4, batches[4])  # live traffic overtaking the replay waits
    for seq in range(0, 4):  # the ROUTER replays from 1; a stale 0 would be a duplicate
        await ing.on_batch(seq, batches[seq], replayed=True)
    await ing.replay_finished(True)
    await ing.on_batch(3, batches[3])  # live duplicate of a replayed batch
    await ing.on_batch(5, batches[5])
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 6}
    assert ing.state == "synced" and ing.stats.last_seq == 5
    assert ing.stats.duplicates == 2 and ing.stats.restarts == 0 and ing.stats.clears == 0


async def test_replay_that_cannot_fill_the_gap_falls_back_to_resync() -> None:
    eng = SimEngine(BS)
    idx, ing = make(replay=True)
    await ing.on_batch(0, wire(eng.vllm_store(PROMPT[:BS])))
    assert await ing.on_batch(9, wire(eng.vllm_store(PROMPT[:2 * BS], start_block=1))) == ReplayRequest(1)
    await ing.replay_finished(False)  # e.g. timeout
    assert ing.state == "resyncing" and ing.stats.replay_failures == 1
    assert idx.instances() == set() and ing.stats.last_seq == 9
    # First message of a late joiner with replay configured: replay from 0.
    _, late = make(replay=True)
    assert await late.on_batch(7, wire()) == ReplayRequest(0)


async def test_engine_hash_map_is_bounded() -> None:
    eng = SimEngine(BS)
    idx, ing = make(max_engine_hashes=8)
    for i in range(5):
        tokens = list(range(i * 1000, i * 1000 + 3 * BS))
        await ing.on_batch(i, wire(eng.vllm_store(tokens)))
        assert ing.engine_hashes <= 8
    # Evicted entries were removed from the index too: it never holds what we cannot retract.
    held = idx.blocks("p0")
    assert len(held) == ing.engine_hashes == 8
    assert ing.stats.evicted == 15 - 8
    last = own(list(range(4000, 4000 + 3 * BS)), BS)
    assert set(last) <= held


def test_bad_config() -> None:
    with pytest.raises(ValueError):
        InstanceIngestor(MemoryBlockIndex(), "x", block_size=0)
    with pytest.raises(ValueError):
        InstanceIngestor(MemoryBlockIndex(), "x", max_engine_hashes=0)


async def test_offloaded_copies_are_tracked_per_medium() -> None:
    """vLLM with CPU offloading: the same engine hash stored on GPU and CPU, removed one medium at
    a time; the block stays indexed while any copy remains, on the best medium left."""
    eng = SimEngine(BS)
    idx, ing = make()
    tokens = PROMPT[:3 * BS]
    hs = own(tokens, BS)
    gpu = BlockStored(**{**_fields(eng.vllm_store(tokens)), "medium": "GPU"})
    await ing.on_batch(0, wire(gpu, eng.vllm_store(tokens, start_block=1, medium="CPU")))
    assert [idx.medium("p0", h) for h in hs] == ["GPU", "GPU", "GPU"]
    removed_gpu = eng.remove(tokens, [1, 2])
    await ing.on_batch(1, wire(BlockRemoved(removed_gpu.block_hashes, "GPU")))
    assert [idx.medium("p0", h) for h in hs] == ["GPU", "CPU", "CPU"]
    assert idx.lookup(hs) == {"p0": 3} and idx.lookup_detailed(hs) == {"p0": (3, 1)}
    await ing.on_batch(2, wire(BlockRemoved(removed_gpu.block_hashes, "GPU")))  # already gone there
    assert ing.stats.unknown_removed == 2 and idx.lookup(hs) == {"p0": 3}
    await ing.on_batch(3, wire(BlockRemoved(removed_gpu.block_hashes[1:], "CPU")))
    assert idx.lookup(hs) == {"p0": 2}
    await ing.on_batch(4, wire(eng.remove(tokens, [0, 1])))  # no medium: every copy
    assert idx.instances() == set() and ing.engine_hashes == 0


async def test_a_gpu_eviction_then_a_host_store_keeps_the_host_credit() -> None:
    """SGLang's hierarchical cache evicts a block from the GPU (BlockRemoved, medium GPU) and
    then stores it on the host (BlockStored, medium CPU_PINNED): the prefix stays matched, its
    tail on the host tier, instead of vanishing with the GPU copy."""
    eng = SimEngine(BS)
    idx, ing = make()
    tokens = PROMPT[:3 * BS]
    hs = own(tokens, BS)
    await ing.on_batch(0, wire(eng.vllm_store(tokens, medium="GPU")))
    gpu_gone = eng.remove(tokens, [1, 2])
    await ing.on_batch(1, wire(BlockRemoved(gpu_gone.block_hashes, "GPU")))
    assert idx.lookup(hs) == {"p0": 1}
    await ing.on_batch(2, wire(eng.vllm_store(tokens, start_block=1, medium="CPU_PINNED")))
    assert idx.lookup(hs) == {"p0": 3}
    assert idx.match_tiers(idx.model, hs)["p0"].as_dict() == {"device": 1, "host": 2, "disk": 0}
    assert [idx.medium("p0", h) for h in hs] == ["GPU", "CPU_PINNED", "CPU_PINNED"]


def _fields(ev: BlockStored) -> dict:
    return {f: getattr(ev, f) for f in BlockStored.__slots__}


_PROMPTS = branching_prompts(BS)


class IngestMachine(RuleBasedStateMachine):
    """Random vLLM-style stores/removes/clears through the codec; the index always holds exactly
    our own hashes of the blocks the engine holds (refusing stores whose parent is unknown)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.eng = SimEngine(BS, "bytes")
        self.idx, self.ing = make()
        self.seq = 0
        self.held: set[tuple[int, int]] = set()  # (prompt, block) as the engine holds them
        self.refused = 0

    def teardown(self) -> None:
        self.loop.close()

    def send(self, *events: KVEvent) -> None:
        self.loop.run_until_complete(self.ing.on_batch(self.seq, wire(*events, encoding="array")))
        self.seq += 1

    def key(self, p: int, b: int) -> tuple[int, int]:
        return block_key(_PROMPTS, BS, p, b)

    @rule(p=st.integers(0, 2), start=st.integers(0, 5), n=st.integers(1, 3))
    def store(self, p: int, start: int, n: int) -> None:
        end = min(6, start + n)
        self.send(self.eng.vllm_store(_PROMPTS[p][:end * BS], start_block=start))
        if start == 0 or self.key(p, start - 1) in self.held:
            self.held.update(self.key(p, b) for b in range(start, end))
        else:
            self.refused += 1

    @rule(p=st.integers(0, 2), blocks=st.lists(st.integers(0, 5), max_size=3))
    def remove(self, p: int, blocks: list[int]) -> None:
        self.send(self.eng.remove(_PROMPTS[p], blocks))
        self.held.difference_update(self.key(p, b) for b in blocks)

    @rule()
    def clear(self) -> None:
        self.send(AllBlocksCleared())
        self.held.clear()

    @invariant()
    def index_matches_engine(self) -> None:
        want = {own(_PROMPTS[p], BS)[b] for p, b in self.held}
        assert self.idx.blocks("p0") == want
        assert self.ing.engine_hashes == len(self.held)
        assert self.ing.stats.rejected.get("unknown_parent", 0) == self.refused


TestIngestMachine = IngestMachine.TestCase
TestIngestMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


async def test_clear_inside_a_replay_does_not_turn_live_duplicates_into_a_restart() -> None:
    eng = SimEngine(BS)
    idx, ing = make(replay=True)
    tokens = PROMPT[:BS]
    b = [wire(eng.vllm_store(tokens)), wire(), wire(AllBlocksCleared()), wire(eng.vllm_store(tokens)),
         wire(AllBlocksCleared(), eng.vllm_store(tokens))]
    await ing.on_batch(0, b[0])
    assert await ing.on_batch(2, b[2]) == ReplayRequest(1)
    await ing.on_batch(4, b[4])  # held back; it clears too
    for seq in (1, 2, 3):
        await ing.on_batch(seq, b[seq], replayed=True)
    await ing.replay_finished(True)
    for seq in (3, 4):  # live copies still queued in the SUB socket
        await ing.on_batch(seq, b[seq])
    assert ing.stats.restarts == 0 and ing.stats.duplicates == 2
    assert idx.lookup(own(tokens, BS)) == {"p0": 1} and ing.state == "synced"


async def test_a_restart_is_noticed_inside_the_replayed_range() -> None:
    """After a replay of 1..3, a restarted engine whose batches 0 and 1 were lost (slow joiner)
    sends 2 and 3: the same numbers as replayed batches, but not their copies."""
    old, new = SimEngine(BS, salt=b"old"), SimEngine(BS, salt=b"new")
    idx, ing = make(replay=True)
    b = [stamped(i, old.vllm_store(PROMPT[:(i + 1) * BS], start_block=i)) for i in range(4)]
    await ing.on_batch(0, b[0])
    assert await ing.on_batch(2, b[2]) == ReplayRequest(1)
    for seq in (1, 2, 3):
        await ing.on_batch(seq, b[seq], replayed=True)
    await ing.replay_finished(True)
    assert idx.lookup(own(PROMPT, BS)) == {"p0": 4}
    other = list(range(1000, 1000 + 4 * BS))
    nb = [stamped(100 + i, new.vllm_store(other[:(i + 1) * BS], start_block=i)) for i in range(4)]
    assert await ing.on_batch(2, nb[2]) == ReplayRequest(0)
    assert ing.stats.restarts == 1 and ing.stats.duplicates == 0
    assert idx.instances() == set(), "nothing of the old process is claimed"
    for seq in range(4):  # the new process's ROUTER replays from its own start
        await ing.on_batch(seq, nb[seq], replayed=True)
    await ing.replay_finished(True)
    assert ing.state == "synced" and idx.lookup(own(other, BS)) == {"p0": 4}


async def test_a_restart_among_held_back_batches_is_noticed() -> None:
    old, new = SimEngine(BS, salt=b"old"), SimEngine(BS, salt=b"new")
    idx, ing = make(replay=True)
    await ing.on_batch(0, stamped(0, old.vllm_store(PROMPT[:BS])))
    assert await ing.on_batch(2, stamped(2, old.vllm_store(PROMPT[:2 * BS]))) == ReplayRequest(1)
    other = list(range(1000, 1000 + BS))
    await ing.on_batch(0, stamped(100, new.vllm_store(other)))  # held back: a new process
    await ing.replay_finished(False)  # its old ROUTER is gone
    assert ing.stats.restarts == 1 and ing.stats.duplicates == 0
    assert ing.state == "synced" and idx.blocks("p0") == set(own(other, BS))


async def test_a_replay_after_a_restart_starts_the_new_sequence() -> None:
    """A restart noticed by a gap (0 lost, 1 arrives) asks for replay from 0, and the replayed
    batches of the new process are applied, not taken for the old one's duplicates."""
    old, new = SimEngine(BS, salt=b"old"), SimEngine(BS, salt=b"new")
    idx, ing = make(replay=True)
    for seq in range(2):
        await ing.on_batch(seq, stamped(seq, old.vllm_store(PROMPT[:(seq + 1) * BS],
                                                            start_block=seq)))
    other = list(range(1000, 1000 + 2 * BS))
    nb = [stamped(100 + i, new.vllm_store(other[:(i + 1) * BS], start_block=i)) for i in range(2)]
    assert await ing.on_batch(1, nb[1]) == ReplayRequest(0)
    for seq in range(2):
        await ing.on_batch(seq, nb[seq], replayed=True)
    await ing.replay_finished(True)
    assert ing.state == "synced" and ing.stats.duplicates == 0
    assert idx.blocks("p0") == set(own(other, BS))
