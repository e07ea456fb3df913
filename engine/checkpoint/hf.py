"""Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``): Llama, Qwen2, Qwen3.

The geometry comes from ``config.json`` as transformers reads it (older ``rope_theta`` /
``rope_scaling`` keys and the newer ``rope_parameters`` alike). What the engine cannot run the
same way transformers does (RoPE scaling, sliding windows, MLP biases, another activation) is
refused with a message rather than served with wrong numerics.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.checkpoint.formats import HF_ARCHITECTURES, CheckpointError
from engine.config import ModelConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_QKV_BIAS_DEFAULT = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": True,
                     "Qwen3ForCausalLM": False}


def _rope(path: Path, c: dict[str, Any]) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise CheckpointError(str(path), f"RoPE scaling {kind!r} is not supported; only plain RoPE")
    theta = c.get("rope_theta") or params.get("rope_theta") or 10000.0
    return float(theta)


def config_from_hf_dir(path: Path) -> tuple[ModelConfig, str]:
    """(geometry, served name) of the checkpoint directory ``path``."""
    try:
        c = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(str(path), f"config.json unreadable: {e}") from e
    archs = c.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in HF_ARCHITECTURES:
        raise CheckpointError(str(path), f"architecture {arch!r} (config.json) is not supported; "
                              f"supported: {', '.join(HF_ARCHITECTURES)}")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(str(path), "no *.safetensors weights in the directory")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(str(path), f"activation {c['hidden_act']!r} is not supported (silu)")
    if c.get("mlp_bias"):
        raise CheckpointError(str(path), "MLP biases are not supported")
    if c.get("use_sliding_window"):
        raise CheckpointError(str(path), "sliding-window attention is not supported")
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    bias = c.get("attention_bias")
    name = c.get("_name_or_path") or path.name
    cfg = ModelConfig(
        name=name,
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]),
        max_positions=int(c.get("max_position_embeddings") or 2048),
        dtype="float32",
        rope_theta=_rope(path, c),
        rms_eps=float(c.get("rms_norm_eps") or 1e-6),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=_QKV_BIAS_DEFAULT[arch] if bias is None else bool(bias),
        qk_norm=arch == "Qwen3ForCausalLM",
    )
    return cfg, name


def load_safetensors_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` files, under their HF names."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.endswith("rotary_emb.inv_freq"):  # a buffer older exports saved
                    continue
                out[key] = sf.get_tensor(key)
    logger.info("safetensors %s: %d tensors loaded in %.2f s", path, len(out), time.perf_counter() - t0)
    return out
