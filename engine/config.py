"""Model geometry of the reference engine.

Two named configs:

``tiny``
    2 layers, 4 query heads, 2 KV heads (GQA), head_dim 16, hidden 64, float64. It runs in
    milliseconds on a CPU. float64 keeps the math robust against batching: a request's tokens do
    not depend on which other requests share its step (the 32-concurrent test and PD-vs-monolithic
    in #5 rely on this).

``bench``
    32 layers, 8 query heads, 8 KV heads, head_dim 128, bfloat16: 32 * 2 * 8 * 128 * 2 bytes =
    128 KiB of KV per token, the geometry of an 8B-class GQA model. The compute is kept cheap by
    decoupling the residual width from the attention width: ``hidden_size`` is 256 while the
    attention projections map 256 -> 8 * 128 = 1024 per K, V and Q (as e.g. Gemma decouples
    ``head_dim * num_heads`` from ``hidden_size``). The K and V written to the pool are therefore
    real ``[tokens, 8, 128]`` bf16 tensors per layer, produced by the model's own projections, and
    the pool tensor is ``[32, 2, pages, page_size, 8, 128]`` bf16 — the bytes the transfer layer
    moves are exactly those of the large model, only the FLOPs that produce them are fewer.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported lazily so that the CLI can parse engine flags without loading it
BYTE_VOCAB_SIZE = 259
"""The byte tokenizer's vocabulary (256 bytes plus BOS, EOS, PAD): the seeded configs' default.
A literal, not imported: the config must not depend on a tokenizer (real vocabularies differ)."""
_DTYPES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the decoder-only transformer (seeded, or read from a checkpoint)."""

    name: str
    """Short model name (also the default served model name)."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA); ``num_heads`` must be a multiple."""
    head_dim: int
    """Width of one head."""
    hidden_size: int
    """Residual stream width (may differ from ``num_heads * head_dim``)."""
    intermediate_size: int
    """MLP width (SwiGLU)."""
    vocab_size: int = BYTE_VOCAB_SIZE
    """Token ids are ``0 .. vocab_size - 1`` (seeded configs: bytes plus BOS/EOS/PAD)."""
    max_positions: int = 2048
    """Longest sequence (prompt plus output) the model accepts."""
    dtype: str = "float64"
    """Weights, activations and KV dtype: float64, float32, bfloat16 or float16."""
    seed: int = 0
    """Weight seed: the same seed gives the same weights on any machine."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """LM head is the embedding matrix (real checkpoints only; seeded ones draw their own)."""
    qkv_bias: bool = False
    """Q, K and V projections have biases (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of Q and K before RoPE (Qwen3)."""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                           "intermediate_size", "vocab_size", "max_positions"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"model {self.name}: {field_name} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads ({self.num_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model {self.name}: head_dim must be even for RoPE")
        if self.dtype not in _DTYPES:
            raise ValueError(f"model {self.name}: dtype must be one of {sorted(_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt accepted: one position is left for the first generated token."""
        return self.max_positions - 1

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token occupies over all layers (K and V)."""
        elem = _DTYPES[self.dtype]
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def with_overrides(self, **kw: object) -> ModelConfig:
        return replace(self, **kw)  # type: ignore[arg-type]

    def hf_config(self) -> dict[str, object]:
        """A Hugging Face style ``config.json`` describing this model (for model_path dirs)."""
        return {
            "architectures": ["KvatlasByteLM"],
            "model_type": "kvatlas",
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_positions,
            "torch_dtype": self.dtype,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "kvatlas_seed": self.seed,
        }


MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        hidden_size=64, intermediate_size=128, max_positions=2048,
                        dtype="float64"),
    # tiny with 4 KV heads: TP up to 4 splits its heads (the PD tests' (4, 2) rank combination)
    "tiny-kv4": ModelConfig(name="tiny-kv4", num_layers=2, num_heads=8, num_kv_heads=4,
                            head_dim=8, hidden_size=64, intermediate_size=128, max_positions=2048,
                            dtype="float64"),
    "bench": ModelConfig(name="bench", num_layers=32, num_heads=8, num_kv_heads=8, head_dim=128,
                         hidden_size=256, intermediate_size=512, max_positions=32768,
                         dtype="bfloat16"),
}


def get_model_config(name: str, seed: int | None = None) -> ModelConfig:
    """The named config, optionally with another weight seed."""
    try:
        cfg = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    return cfg if seed is None else cfg.with_overrides(seed=seed)
