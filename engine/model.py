"""A decoder-only transformer (RoPE, RMSNorm, GQA, SwiGLU; optional q/k/v biases as in Qwen2 and
per-head q/k RMSNorm as in Qwen3) that reads and writes a paged KV pool.

Weights are seeded, or a real checkpoint's (``Transformer.from_spec`` with a spec from
``engine.checkpoint.resolve_model``: Llama/Qwen2/Qwen3 safetensors directories, GGUF files).
Seeded weights come from a ``torch.Generator`` on the CPU with a fixed seed, drawn as uniform float64
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
are replicated (so are q/k norms; q/k/v biases are split with their heads).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.checkpoint.formats import CheckpointError
from engine.config import ModelConfig
from engine.kv_pool import KVPool

if TYPE_CHECKING:
    from engine.checkpoint.spec import ModelSpec

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

    @classmethod
    def from_weights(cls, cfg: ModelConfig, w: Mapping[str, torch.Tensor], i: int) -> Layer:
        """Layer ``i`` from HF-named tensors (``[out, in]`` projections kept as transposed views,
        so models built from one weights dict, e.g. TP shards in one process, share storage)."""
        h, q, kv, d = cfg.hidden_size, cfg.num_heads * cfg.head_dim, \
            cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        p = f"model.layers.{i}."
        layer = cls.__new__(cls)
        layer.attn_norm = _take(w, p + "input_layernorm.weight", (h,))
        layer.wq = _take(w, p + "self_attn.q_proj.weight", (q, h)).t()
        layer.wk = _take(w, p + "self_attn.k_proj.weight", (kv, h)).t()
        layer.wv = _take(w, p + "self_attn.v_proj.weight", (kv, h)).t()
        layer.wo = _take(w, p + "self_attn.o_proj.weight", (h, q)).t()
        if cfg.qkv_bias:
            layer.bq = _take(w, p + "self_attn.q_proj.bias", (q,))
            layer.bk = _take(w, p + "self_attn.k_proj.bias", (kv,))
            layer.bv = _take(w, p + "self_attn.v_proj.bias", (kv,))
        if cfg.qk_norm:
            layer.q_norm = _take(w, p + "self_attn.q_norm.weight", (d,))
            layer.k_norm = _take(w, p + "self_attn.k_norm.weight", (d,))
        layer.mlp_norm = _take(w, p + "post_attention_layernorm.weight", (h,))
        layer.w_gate = _take(w, p + "mlp.gate_proj.weight", (cfg.intermediate_size, h)).t()
        layer.w_up = _take(w, p + "mlp.up_proj.weight", (cfg.intermediate_size, h)).t()
        layer.w_down = _take(w, p + "mlp.down_proj.weight", (h, cfg.intermediate_size)).t()
        return layer

    def to(self, dtype: torch.dtype, device: torch.device | str, contiguous: bool = True) -> None:
        for name, t in vars(self).items():
            t = t.to(device=device, dtype=dtype)
            setattr(self, name, t.contiguous() if contiguous else t)


def _take(w: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor ``name`` of a checkpoint, checked against the shape the config implies."""
    try:
        t = w[name]
    except KeyError:
        raise CheckpointError(name, "tensor missing from the checkpoint") from None
    if tuple(t.shape) != shape:
        raise CheckpointError(name, f"shape {tuple(t.shape)} does not match the config's {shape}")
    return t


class Transformer:
    """The model. ``kv_heads`` selects the KV heads (and their query heads) this copy computes."""

    def __init__(self, cfg: ModelConfig, device: str | torch.device = "cpu",
                 kv_heads: range | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None) -> None:
        """Seeded weights from ``cfg.seed``, or ``weights``: a checkpoint's tensors under
        Hugging Face Llama names (``engine.checkpoint.load_weights``)."""
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.kv_heads = kv_heads if kv_heads is not None else range(cfg.num_kv_heads)
        if not self.kv_heads or self.kv_heads.start < 0 or self.kv_heads.stop > cfg.num_kv_heads:
            raise ValueError(f"kv_heads {self.kv_heads} outside 0..{cfg.num_kv_heads}")
        h = cfg.hidden_size
        if weights is None:
            gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
            self.embed = _uniform(gen, (cfg.vocab_size, h), 1.0)
            self.layers = [Layer(cfg, gen) for _ in range(cfg.num_layers)]
            self.final_norm = 1.0 + _uniform(gen, (h,), 0.1)
            self.lm_head = _uniform(gen, (h, cfg.vocab_size), 4.0 / math.sqrt(h))
        else:
            self.embed = _take(weights, "model.embed_tokens.weight", (cfg.vocab_size, h))
            self.layers = [Layer.from_weights(cfg, weights, i) for i in range(cfg.num_layers)]
            self.final_norm = _take(weights, "model.norm.weight", (h,))
            self.lm_head = None if cfg.tie_embeddings else \
                _take(weights, "lm_head.weight", (cfg.vocab_size, h)).t()
        for t in ("embed", "final_norm", "lm_head"):
            if getattr(self, t) is not None:
                setattr(self, t, getattr(self, t).to(device=self.device, dtype=self.dtype))
        if self.lm_head is None:  # tied: the embedding matrix, transposed (a view, no copy)
            self.lm_head = self.embed.t()
        for layer in self.layers:
            # seeded: contiguous copies (the pinned tests hash them); a checkpoint's tensors stay
            # views of the loaded storage
            layer.to(self.dtype, self.device, contiguous=weights is None)
            self._shard(layer, contiguous=weights is None)
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
                                       / cfg.head_dim)
        ang = torch.outer(torch.arange(cfg.max_positions, dtype=torch.float64), inv)
        self.cos = torch.cos(ang).to(device=self.device, dtype=self.dtype)
        self.sin = torch.sin(ang).to(device=self.device, dtype=self.dtype)

    def _shard(self, layer: Layer, contiguous: bool = True) -> None:
        """Split the attention weights per KV head group and keep this copy's groups.

        Every projection is one matmul per group, in a full model as in a shard, so a shard
        computes exactly the same floating-point operations for its heads as a full model does.
        """
        d, g = self.cfg.head_dim, self.cfg.group_size
        heads = self.kv_heads

        def cut(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous() if contiguous else t

        layer.wq_groups = [cut(layer.wq[:, k * g * d:(k + 1) * g * d]) for k in heads]
        layer.wk_groups = [cut(layer.wk[:, k * d:(k + 1) * d]) for k in heads]
        layer.wv_groups = [cut(layer.wv[:, k * d:(k + 1) * d]) for k in heads]
        layer.wo_groups = [cut(layer.wo[k * g * d:(k + 1) * g * d]) for k in heads]
        del layer.wq, layer.wk, layer.wv, layer.wo
        if self.cfg.qkv_bias:
            layer.bq_groups = [layer.bq[k * g * d:(k + 1) * g * d] for k in heads]
            layer.bk_groups = [layer.bk[k * d:(k + 1) * d] for k in heads]
            layer.bv_groups = [layer.bv[k * d:(k + 1) * d] for k in heads]
            del layer.bq, layer.bk, layer.bv

    @classmethod
    def from_spec(cls, spec: ModelSpec, device: str | torch.device = "cpu",
                  kv_heads: range | None = None) -> Transformer:
        """The model ``spec`` names: seeded, or with its checkpoint's weights (sharded to
        ``kv_heads``)."""
        if spec.checkpoint is None:
            return cls(spec.config, device=device, kv_heads=kv_heads)
        from engine.checkpoint import load_weights

        return cls(spec.config, device=device, kv_heads=kv_heads, weights=load_weights(spec))

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
            if cfg.qkv_bias:
                q = torch.cat([h @ w + b for w, b in zip(layer.wq_groups, layer.bq_groups,
                                                         strict=True)], 1)
                k = torch.stack([h @ w + b for w, b in zip(layer.wk_groups, layer.bk_groups,
                                                           strict=True)], 1)
                v = torch.stack([h @ w + b for w, b in zip(layer.wv_groups, layer.bv_groups,
                                                           strict=True)], 1)
            else:
                q = torch.cat([h @ w for w in layer.wq_groups], 1)
                k = torch.stack([h @ w for w in layer.wk_groups], 1)
                v = torch.stack([h @ w for w in layer.wv_groups], 1)
            q = q.view(-1, nkv * g, d)
            if cfg.qk_norm:  # Qwen3: RMSNorm over each head's width, before RoPE
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            q, k = self._rope(q, pos), self._rope(k, pos)
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
