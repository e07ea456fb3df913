"""The seeded transformer and the paged pool: determinism, chunked prefill, head shards, page I/O,
the bench geometry."""
from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from engine.config import get_model_config
from engine.errors import PoolExhausted
from engine.kv_pool import KVPool
from engine.model import SeqChunk, Transformer, ordered_sum

TINY = get_model_config("tiny")


def _pool(cfg=TINY, pages: int = 32, kv_heads: range | None = None) -> KVPool:
    return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.torch_dtype, pages,
                  kv_heads=kv_heads)


def _digest(m: Transformer) -> str:
    h = hashlib.sha256()
    tensors = [m.embed, m.lm_head, m.final_norm]
    for layer in m.layers:
        for w in vars(layer).values():
            tensors.extend(w if isinstance(w, list) else [w])
    assert len(tensors) == 3 + TINY.num_layers * (5 + 4 * TINY.num_kv_heads)
    for t in tensors:
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def test_same_seed_same_weights_other_seed_differs() -> None:
    assert _digest(Transformer(TINY)) == _digest(Transformer(TINY))
    assert _digest(Transformer(TINY)) != _digest(Transformer(TINY.with_overrides(seed=1)))


def test_chunked_prefill_and_decode_match_one_shot_prefill() -> None:
    m = Transformer(TINY)
    toks = [256, *range(60)]
    pool = _pool()
    full = m.forward([SeqChunk(toks, 0, [0, 1, 2, 3])], pool)
    # the same sequence in three chunks plus a decode step, in other pages, batched with another
    table = [8, 9, 10, 11]
    m.forward([SeqChunk(toks[:16], 0, table)], pool)
    m.forward([SeqChunk(toks[16:40], 16, table), SeqChunk([256, 5, 6], 0, [20])], pool)
    m.forward([SeqChunk(toks[40:60], 40, table)], pool)
    last = m.forward([SeqChunk(toks[60:], 60, table)], pool)
    torch.testing.assert_close(last, full, rtol=0, atol=1e-12)
    # the K/V written by both paths agree
    k_full, _ = pool.gather(1, [0, 1, 2, 3], len(toks))
    k_chunk, _ = pool.gather(1, table, len(toks))
    torch.testing.assert_close(k_chunk, k_full, rtol=0, atol=1e-12)


def test_kv_head_shard_writes_its_slice_of_the_full_kv() -> None:
    """A model built for a subset of KV heads writes exactly those heads' K/V (layer 0 depends
    only on the embedding, so the shard's K/V equal the full model's bit for bit)."""
    toks = [256, 1, 2, 3, 4, 5]
    full, full_pool = Transformer(TINY), _pool()
    full.forward([SeqChunk(toks, 0, [0])], full_pool)
    for h in range(TINY.num_kv_heads):
        shard, pool = Transformer(TINY, kv_heads=range(h, h + 1)), _pool(kv_heads=range(h, h + 1))
        shard.forward([SeqChunk(toks, 0, [0])], pool)
        assert torch.equal(pool.kv[0, :, 0], full_pool.kv[0, :, 0, :, h:h + 1])
    with pytest.raises(ValueError, match="kv heads"):
        Transformer(TINY, kv_heads=range(0, 1)).forward([SeqChunk(toks, 0, [0])], _pool())


def test_pages_copy_out_and_in_by_id() -> None:
    m, pool = Transformer(TINY), _pool()
    m.forward([SeqChunk([256, *range(40)], 0, [3, 7, 5])], pool)
    data = pool.read_pages([3, 7, 5])
    assert data.shape == (TINY.num_layers, 2, 3, 16, TINY.num_kv_heads, TINY.head_dim)
    other = _pool()
    other.write_pages([0, 1, 2], data)
    assert torch.equal(other.read_pages([0, 1, 2]), data)
    with pytest.raises(ValueError, match="does not match"):
        other.write_pages([0, 1], data)


def test_pool_accounting() -> None:
    pool = _pool(pages=4)
    pages = pool.alloc(3)
    assert pool.num_free == 1
    with pytest.raises(PoolExhausted):
        pool.alloc(2)
    pool.incref(pages[0])
    assert pool.decref(pages[0]) == 1 and pool.decref(pages[0]) == 0
    pool.release(pages[0])
    with pytest.raises(RuntimeError):
        pool.decref(pages[0])
    assert pool.num_free == 2


def test_bench_geometry_is_real() -> None:
    cfg = get_model_config("bench")
    assert cfg.kv_bytes_per_token == 128 * 1024
    pool = _pool(cfg, pages=2)
    assert pool.kv.shape == (32, 2, 2, 16, 8, 128) and pool.kv.dtype == torch.bfloat16
    assert pool.bytes_per_page == 16 * 128 * 1024
    logits = Transformer(cfg).forward([SeqChunk([256, *range(20)], 0, [0, 1])], pool)
    assert logits.shape == (1, cfg.vocab_size) and torch.isfinite(logits).all()
    # every layer's K and V of the 21 written positions are model output, not the zero fill
    written = pool.kv.view(32, 2, 32, 8, 128)[:, :, :21]
    assert (written.abs().amax(dim=(-1, -2)) > 0).all()
    assert not pool.kv.view(32, 2, 32, 8, 128)[:, :, 21:].any()


def test_tp_shards_exchanging_partials_reproduce_the_full_model_bitwise() -> None:
    """Two KV-head shards run side by side (threads standing in for TP ranks); their combine
    gathers both ranks' per-group partials and adds them in group order. Logits and every
    layer's K/V equal the one-rank model's exactly, which is what #5's PD-vs-monolithic test
    relies on."""
    toks = [256, *range(30)]
    full, full_pool = Transformer(TINY), _pool()
    want = full.forward([SeqChunk(toks[:20], 0, [0, 1]), SeqChunk(toks, 0, [2, 3])], full_pool)
    tp = TINY.num_kv_heads
    barrier = threading.Barrier(tp)
    posted: list[list[torch.Tensor]] = [[] for _ in range(tp)]
    got: list[torch.Tensor | None] = [None] * tp
    pools = [_pool(kv_heads=range(r, r + 1)) for r in range(tp)]

    def rank(r: int) -> None:
        def combine(parts: list[torch.Tensor]) -> torch.Tensor:
            posted[r] = parts
            barrier.wait()
            gathered = [p for rr in range(tp) for p in posted[rr]]
            barrier.wait()  # everyone has read before the next layer posts again
            return ordered_sum(gathered)

        model = Transformer(TINY, kv_heads=range(r, r + 1))
        got[r] = model.forward([SeqChunk(toks[:20], 0, [0, 1]), SeqChunk(toks, 0, [2, 3])],
                               pools[r], combine=combine)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in range(tp):
        assert got[r] is not None and torch.equal(got[r], want)
        assert torch.equal(pools[r].kv, full_pool.kv[..., r:r + 1, :])
