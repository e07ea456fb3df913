"""Prefix cache: exact cache hits, LRU eviction, KV events that reproduce the cache's block set
when replayed, and the prefill -> decode page hand-off (the hooks #5 builds on). Events are
replayed (through the real ZMQ publisher, its replay socket and the index ingestor)."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from engine_helpers import greedy, requests, shared_prefix_prompts
from memory_index import MemoryBlockIndex

from engine.config import get_model_config
from engine.kv_pool import KVPool
from engine.prefix_cache import PrefixCache
from engine.runner import AsyncEngine, build_scheduler, run_to_completion
from engine.scheduler import Request
from index.events.codec import END_SEQ, decode_payload, decode_seq
from index.events.ingest import InstanceIngestor
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvatlas.etcd_proc import free_port

TINY = get_model_config("tiny")


def test_cache_hits_are_exact_over_220_prompts() -> None:
    prompts = shared_prefix_prompts(220, seed=11)
    plain = build_scheduler(TINY, 256, enable_prefix_cache=False)
    cached = build_scheduler(TINY, 256, model=plain.model)
    params = greedy(6)
    want = {}
    got = {}
    for i, p in enumerate(prompts):  # one at a time, so later prompts hit earlier ones' blocks
        want.update(run_to_completion(plain, [Request(f"p{i}", p, params)]))
        got.update(run_to_completion(cached, [Request(f"p{i}", p, params)]))
    assert [got[k].output_ids for k in want] == [want[k].output_ids for k in want]
    hits = [c.cached_tokens for c in got.values() if c.cached_tokens]
    assert len(hits) > 150, f"only {len(hits)} of 220 prompts hit the cache"
    assert all(c.cached_tokens == 0 for c in want.values())
    assert cached.totals["prefill_computed_tokens"] == (
        plain.totals["prefill_computed_tokens"] - sum(hits))
    # all at once: hits on blocks stored moments ago, and duplicates computed side by side
    again = run_to_completion(cached, requests(prompts, params, tag="p"))
    assert [again[k].output_ids for k in want] == [want[k].output_ids for k in want]
    assert cached.cache.pages_in_use == 0


def _cache(pages: int) -> PrefixCache:
    return PrefixCache(KVPool(1, 1, 2, TINY.torch_dtype, pages, page_size=4))


def test_lru_evicts_chain_tails_first_and_never_referenced_blocks() -> None:
    cache = _cache(6)
    toks = list(range(12))
    hashes = cache.hashes(toks)
    table = cache.allocate(3)
    cache.store(table, 0, hashes, None, toks)
    assert cache.drain_events() == [BlockStored(hashes, None, toks, 4)]
    cache.release(table)
    other = cache.allocate(3)  # the free pages; nothing evicted yet
    assert cache.drain_events() == []
    held = cache.match(hashes[:1])  # head block referenced again
    assert held == table[:1]
    cache.allocate(2)  # must evict two unreferenced blocks: the tail first
    assert cache.drain_events() == [BlockRemoved([hashes[2], hashes[1]])]
    assert cache.blocks() == {hashes[0]}
    assert cache.available() == 0
    cache.release(held)
    cache.release(other)
    assert cache.available() == 4


def test_duplicate_block_shares_the_cached_page() -> None:
    cache = _cache(4)
    toks = list(range(8))
    hashes = cache.hashes(toks)
    a, b = cache.allocate(2), cache.allocate(2)
    cache.store(a, 0, hashes, None, toks)
    b_before = list(b)
    cache.store(b, 0, hashes, None, toks)
    assert b == a and cache.pool.num_free == 2  # b's own copies went back to the free list
    assert all(cache.pool.refcount(p) == 2 for p in a)
    assert set(b_before).isdisjoint(a)
    assert len(cache.drain_events()) == 1


async def _replay(dealer: zmq.asyncio.Socket, start: int) -> list[tuple[int, bytes]]:
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        frames = await asyncio.wait_for(dealer.recv_multipart(), 10)
        if frames[2] == END_SEQ:
            return out
        out.append((decode_seq(frames[2]), frames[3]))


async def test_eviction_under_small_pool_keeps_events_consistent() -> None:
    sched = build_scheduler(TINY, 40, max_batch_tokens=64)
    cache = sched.cache
    pub_port, replay_port = free_port(), free_port()
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    publisher = KVEventPublisher(PublisherConfig(
        endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"))
    await publisher.start()
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    index = MemoryBlockIndex()
    ingest = InstanceIngestor(index, "engine-0", block_size=16)
    kinds: set[type] = set()
    try:
        prompts = shared_prefix_prompts(160, seed=5, n_bases=10, tail_len=(10, 60))
        next_seq = 0
        for wave in range(0, len(prompts), 8):
            batch = requests(prompts[wave:wave + 8], greedy(4), tag=f"w{wave}-")
            run_to_completion(sched, batch)
            if wave == 80:
                assert sched.flush_cache() is not None
            kinds |= {type(e) for e in cache.events}
            publisher.drain(cache.events)
            for seq, payload in await _replay(dealer, next_seq):
                assert seq == next_seq
                assert await ingest.on_batch(seq, decode_payload(payload)) is None
                next_seq += 1
            assert index.blocks("engine-0") == cache.blocks(), f"after wave {wave}"
            assert cache.available() == sched.pool.num_pages  # every page unreferenced again
        assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}
        assert cache.evictions > 100 and ingest.stats.rejected == {}
    finally:
        await publisher.close()
        dealer.close(0)
        ctx.term()


def test_prefill_kv_copied_by_page_into_another_engine_decodes_the_same_tokens() -> None:
    """The disaggregation hooks: one engine prefills (with prefix hits) and holds its pages,
    another reserves pages, receives the K/V page by page and decodes from the first token; the
    tokens equal a monolithic run's. Mismatched hand-offs are refused."""
    prompts = shared_prefix_prompts(12, seed=8, n_bases=2)
    mono = build_scheduler(TINY, 256)
    want = run_to_completion(mono, requests(prompts, greedy(10)))
    prefill = build_scheduler(TINY, 256, model=mono.model)
    decode = build_scheduler(TINY, 256, model=mono.model)
    for i, p in enumerate(prompts):
        req = Request(f"r{i}", p, greedy(1))
        req.hold_pages = True
        first = run_to_completion(prefill, [req])[req.rid].output_ids[0]
        held = prefill.held[req.rid]
        pages = decode.reserve(len(p), 10)
        assert pages is not None
        n_prompt_pages = -(-len(p) // 16)
        decode.pool.write_pages(pages[:n_prompt_pages],
                                prefill.pool.read_pages(held[:n_prompt_pages]))
        assert prefill.release_held(req.rid) and not prefill.release_held(req.rid)
        dreq = Request(f"r{i}", p, greedy(10))
        out = decode.add_prefilled(dreq, pages, first)
        assert out.new_ids == [first]
        while decode.has_work:
            decode.step()
        assert dreq.output == want[f"r{i}"].output_ids
    assert prefill.totals["cached_tokens"] > 0  # later prompts reused earlier prefixes
    assert prefill.cache.pages_in_use == 0 == decode.cache.pages_in_use
    assert decode.cache.blocks() == set()  # received KV is not published as this engine's own
    with pytest.raises(ValueError, match="do not cover"):
        decode.add_prefilled(Request("x", prompts[0], greedy(10)), [0], 1)


async def test_async_engine_hand_off_between_two_engines() -> None:
    """The same hand-off through ``AsyncEngine`` (every pool access in each engine's thread)."""
    prompt = shared_prefix_prompts(1, seed=9)[0]
    mono = build_scheduler(TINY, 64)
    want = run_to_completion(mono, [Request("m", prompt, greedy(12))])["m"].output_ids
    prefill = AsyncEngine(build_scheduler(TINY, 64, model=mono.model))
    decode = AsyncEngine(build_scheduler(TINY, 64, model=mono.model))
    await prefill.start()
    await decode.start()
    try:
        outs = [o async for o in prefill.generate(prompt, greedy(1), rid="x", hold_pages=True)]
        first = outs[-1].new_ids[0]
        held = prefill.scheduler.held["x"][:-(-len(prompt) // 16)]
        data = await prefill.call(prefill.scheduler.pool.read_pages, held)
        assert await prefill.call(prefill.scheduler.release_held, "x")
        pages = await decode.call(decode.scheduler.reserve, len(prompt), 12)
        assert isinstance(pages, list)
        await decode.call(decode.scheduler.pool.write_pages, pages[:len(held)], data)
        got = [t async for o in decode.generate_prefilled(Request("x", prompt, greedy(12)),
                                                          pages, first) for t in o.new_ids]
        assert got == want
        assert prefill.scheduler.cache.pages_in_use == 0 == decode.scheduler.cache.pages_in_use
    finally:
        await prefill.stop()
        await decode.stop()
