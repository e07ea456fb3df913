"""The reference engine's host tier, with real tensors: blocks evicted from the device pool move
to a host LRU and come back on a hit with their exact K/V (greedy tokens equal a fresh run's),
and the events tell the index which tier holds them, as vLLM's offloading does."""
from __future__ import annotations

import asyncio

import pytest
from memory_index import MemoryBlockIndex

from engine.config import get_model_config
from engine.prefix_cache import PrefixCache
from engine.runner import build_scheduler, run_to_completion
from engine.sampling import SamplingParams
from engine.scheduler import Request
from index.events.ingest import InstanceIngestor
from index.events.types import KVEventBatch

CFG = get_model_config("tiny")
PAGE = 16


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(blocks * PAGE + 3)]


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def run(sched, rid: str, tokens: list[int]):  # type: ignore[no-untyped-def]
    return run_to_completion(sched, [Request(rid, tokens, greedy())])[rid]


def index_of(cache: PrefixCache, idx: MemoryBlockIndex, ing: InstanceIngestor,
             seq: list[int]) -> None:
    """Apply the cache's events so far to ``idx`` (one batch)."""
    events = cache.drain_events()
    if events:
        asyncio.run(ing.on_batch(seq[0], KVEventBatch(0.0, events)))
        seq[0] += 1


def test_evicted_blocks_move_to_the_host_and_come_back_exactly() -> None:
    # 14 device pages: one 6-block prompt (7 pages with its generation) and then another push
    # the first one's blocks out.
    sched = build_scheduler(CFG, num_pages=14, page_size=PAGE, host_pages=32)
    cache = sched.cache
    idx, ing, seq = MemoryBlockIndex(), None, [0]
    ing = InstanceIngestor(idx, "p0", block_size=PAGE)
    a, b = prompt(1), prompt(2)
    first = run(sched, "a1", a)
    index_of(cache, idx, ing, seq)
    hashes_a = cache.hashes(a)[:6]
    assert idx.match_tiers(idx.model, hashes_a)["p0"].as_dict() == {"device": 6, "host": 0,
                                                                     "disk": 0}
    for i, other in enumerate((b, prompt(3), prompt(4))):  # device full: a's blocks go to host
        run(sched, f"b{i}", other)
    index_of(cache, idx, ing, seq)
    assert not set(hashes_a) & cache.blocks() and set(hashes_a) <= cache.host_hashes()
    tiers = idx.match_tiers(idx.model, hashes_a)["p0"]
    assert tiers.host == 6 and tiers.device == 0, tiers
    again = run(sched, "a2", a)
    index_of(cache, idx, ing, seq)
    # Copied back, not recomputed: counted as cached, and the same tokens as a fresh engine.
    assert again.cached_tokens == 6 * PAGE and cache.host_restores == 6
    fresh = build_scheduler(CFG, num_pages=64, page_size=PAGE)
    assert again.output_ids == first.output_ids == run(fresh, "f", a).output_ids
    tiers = idx.match_tiers(idx.model, hashes_a)["p0"]
    assert (tiers.device, tiers.host) == (6, 0), tiers
    assert ing.stats.rejected == {}, ing.stats.rejected
    assert idx.blocks("p0") == cache.blocks() | cache.host_hashes()  # the index follows both tiers


def test_the_host_lru_is_bounded_and_its_evictions_are_published() -> None:
    sched = build_scheduler(CFG, num_pages=8, page_size=PAGE, host_pages=4)
    cache = sched.cache
    idx = MemoryBlockIndex()
    ing = InstanceIngestor(idx, "p0", block_size=PAGE)
    seq = [0]
    for i in range(5):
        run(sched, f"r{i}", prompt(10 + i, blocks=4))
        index_of(cache, idx, ing, seq)
        assert cache.host_blocks <= 4
    assert cache.host_evictions > 0
    assert idx.blocks("p0") == cache.blocks() | cache.host_hashes()
    assert ing.stats.rejected == {}


def test_without_a_host_tier_evicted_blocks_are_dropped() -> None:
    sched = build_scheduler(CFG, num_pages=14, page_size=PAGE)
    run(sched, "a", prompt(1))
    run(sched, "b", prompt(2))
    run(sched, "c", prompt(3))
    assert sched.cache.host_blocks == 0 and sched.cache.evictions > 0
    assert run(sched, "a2", prompt(1)).cached_tokens < 6 * PAGE


def test_a_negative_host_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="host_pages"):
        build_scheduler(CFG, num_pages=8, host_pages=-1)
