"""A seeded decoder-only transformer (RoPE, RMSNorm, GQA, SwiGLU) that reads and writes a paged
KV pool.

Weights come from a ``torch.Generator`` on the CPU with a fixed seed, drawn as uniform float64
(``torch.rand``: plain mt19937 output, no vectorised transcendental paths) and then cast, so the
same seed gives bit-identical weights on any machine and any device they are moved to later.

One forward serves a whole scheduler step: a list of ``SeqChunk`` (a prefill chunk or one decode
token per sequence). Attention runs per sequence over the K/V it reads back from the pool, so a
cached prefix is read exactly like a freshly written one. Dense layers (projections, MLP, LM head)
run over all tokens of the step at once, and a matmul's blocking and reduction order depend on its
shape: a request's logits can differ in the last bits with what else shares its step. They are
not bit-identical across batch shapes. What the tests compare across batchings (and PD vs
monolithic) are greedy tokens: the tiny model computes in float64, where such differences are
~1e-16 relative and can flip a token only on a near-exact tie of the top two logits.

Tensor parallelism (#5): a model built for ``kv_heads=range(a, b)`` owns those KV heads and their
query heads, and a pool built with the same range holds only their K/V. Every attention
projection is computed as one matmul per KV head group, in the full model exactly as in a shard,
so a shard's K/V are bit-identical to the full model's for its heads. The output projection gives
one partial sum per group and ``combine`` adds them (default: ``ordered_sum``, ascending group
order); a TP rank passes a ``combine`` that gathers every rank's group partials and adds them in
the same order, which reproduces a one-rank run bit for bit. Embedding, norms, MLP and LM head
are replicated.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv_pool import KVPool

Combine = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence to run: ``tokens`` sit at positions ``start .. start + n - 1``;
    K/V of positions before ``start`` are already in the pool; ``table`` covers every position."""

    tokens: Sequence[int]
    start: int
    table: Sequence[int]


def ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum left to right (fixed order, so sharded runs can reproduce it bit for bit)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _uniform(gen: torch.Generator, shape: tuple[int, ...], bound: float) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2.0 - 1.0) * bound


class Layer:
    def __init__(self, cfg: ModelConfig, gen: torch.Generator) -> None:
        h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, \
            cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        self.attn_norm = 1.0 + _uniform(gen, (h,), 0.1)
        self.wq = _uniform(gen, (h, q), 1.0 / math.sqrt(h))
        self.wk = _uniform(gen, (h, kv), 1.0 / math.sqrt(h))
        self.wv = _uniform(gen, (h, kv), 1.0 / math.sqrt(h))
        self.wo = _uniform(gen, (q, h), 1.0 / math.sqrt(q))
        self.mlp_norm = 1.0 + _uniform(gen, (h,), 0.1)
        self.w_gate = _uniform(gen, (h, i), 1.0 / math.sqrt(h))
        self.w_up = _uniform(gen, (h, i), 1.0 / math.sqrt(h))
        self.w_down = _uniform(gen, (i, h), 1.0 / math.sqrt(i))

    def to(self, dtype: torch.dtype, device: torch.device | str) -> None:
        for name, t in vars(self).items():
            setattr(self, name, t.to(device=device, dtype=dtype).contiguous())


class Transformer:
    """The model. ``kv_heads`` selects the KV heads (and their query heads) this copy computes."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu",
                 kv_heads: range | None = None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.kv_heads = kv_heads if kv_heads is not None else range(cfg.num_kv_heads)
        if not self.kv_heads or self.kv_heads.start < 0 or self.kv_heads.stop > cfg.num_kv_heads:
            raise ValueError(f"kv_heads {self.kv_heads} outside 0..{cfg.num_kv_heads}")
        gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
        h = cfg.hidden_size
        self.embed = _uniform(gen, (cfg.vocab_size, h), 1.0)
        self.layers = [Layer(cfg, gen) for _ in range(cfg.num_layers)]
        self.final_norm = 1.0 + _uniform(gen, (h,), 0.1)
        self.lm_head = _uniform(gen, (h, cfg.vocab_size), 4.0 / math.sqrt(h))
        for t in ("embed", "final_norm", "lm_head"):
            setattr(self, t, getattr(self, t).to(device=self.device, dtype=self.dtype))
        for layer in self.layers:
            layer.to(self.dtype, self.device)
            self._shard(layer)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                       / cfg.head_dim)
        ang = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
        self.cos = torch.cos(ang).to(device=self.device, dtype=self.dtype)
        self.sin = torch.sin(ang).to(device=self.device, dtype=self.dtype)

    def _shard(self, layer: Layer) -> None:
        """Split the attention weights per KV head group and keep this copy's groups.

        Every projection is one matmul per group, in a full model as in a shard, so a shard
        computes exactly the same floating-point operations for its heads as a full model does.
        """
        d, g = self.cfg.head_dim, self.cfg.group_size
        heads = self.kv_heads
        layer.wq_groups = [layer.wq[:, k * g * d:(k + 1) * g * d].contiguous() for k in heads]
        layer.wk_groups = [layer.wk[:, k * d:(k + 1) * d].contiguous() for k in heads]
        layer.wv_groups = [layer.wv[:, k * d:(k + 1) * d].contiguous() for k in heads]
        layer.wo_groups = [layer.wo[k * g * d:(k + 1) * g * d].contiguous() for k in heads]
        del layer.wq, layer.wk, layer.wv, layer.wo

    # -- pieces ----------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg.rms_eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
                ) -> torch.Tensor:
        """Causal attention of one KV head group: ``q`` [n, g, d] (positions start..) over
        ``k``/``v`` [L, d]; returns [n, g * d]. One group at a time, so that a shard holding
        some of the groups runs exactly the same operations for them as the full model."""
        n, length = q.shape[0], k.shape[0]
        scores = torch.einsum("ngd,ld->gnl", q, k) / math.sqrt(self.cfg.head_dim)
        qpos = torch.arange(start, start + n, device=q.device).unsqueeze(1)
        mask = torch.arange(length, device=q.device).unsqueeze(0) > qpos
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("gnl,ld->ngd", probs, v).reshape(n, -1)

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], pool: KVPool,
                combine: Combine = ordered_sum) -> torch.Tensor:
        """Run ``chunks``; writes their K/V into ``pool``; returns float64 logits
        ``[len(chunks), vocab]`` of each chunk's last token."""
        if pool.kv_heads != self.kv_heads:
            raise ValueError(f"pool holds kv heads {pool.kv_heads}, model computes {self.kv_heads}")
        cfg = self.cfg
        d, g, nkv = cfg.head_dim, cfg.group_size, len(self.kv_heads)
        toks = torch.as_tensor([t for c in chunks for t in c.tokens], dtype=torch.long,
                               device=self.device)
        pos = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks]
                        ).to(self.device)
        slots = torch.cat([pool.slots(c.table, c.start, len(c.tokens)) for c in chunks]
                          ).to(pool.kv.device)
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c.tokens))
        x = self.embed[toks]
        for li, layer in enumerate(self.layers):
            h = self._norm(x, layer.attn_norm)
            q = self._rope(torch.cat([h @ w for w in layer.wq_groups], 1).view(-1, nkv * g, d),
                           pos)
            k = self._rope(torch.stack([h @ w for w in layer.wk_groups], 1), pos)
            v = torch.stack([h @ w for w in layer.wv_groups], 1)
            pool.write(li, slots, k, v)
            outs: list[list[torch.Tensor]] = [[] for _ in range(nkv)]
            for ci, c in enumerate(chunks):
                lo, hi = bounds[ci], bounds[ci + 1]
                kc, vc = pool.gather(li, c.table, c.start + len(c.tokens))
                if kc.dtype != q.dtype:  # a KV cache stored in another dtype (--kv-cache-dtype)
                    kc, vc = kc.to(q.dtype), vc.to(q.dtype)
                qc = q[lo:hi].view(-1, nkv, g, d)
                for grp in range(nkv):
                    outs[grp].append(self._attend(qc[:, grp], kc[:, grp], vc[:, grp], c.start))
            parts = [torch.cat(outs[grp]) @ layer.wo_groups[grp] for grp in range(nkv)]
            x = x + combine(parts)
            h = self._norm(x, layer.mlp_norm)
            x = x + (torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down
        last = torch.as_tensor([b - 1 for b in bounds[1:]], device=self.device)
        logits = self._norm(x[last], self.final_norm) @ self.lm_head
        return logits.to(torch.float64)
