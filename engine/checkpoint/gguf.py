"""GGUF checkpoints (llama, qwen2, qwen3): geometry from the metadata, tensors dequantized with
the ``gguf`` package and renamed to Hugging Face Llama names.

llama.cpp's converter stores a *llama* model's Q and K projection rows permuted for its
interleaved ("GPT-J") rotary layout: per head, rows ``[0, d/2, 1, d/2+1, ...]`` of the HF
half-split layout. :func:`unpermute` undoes it so the engine's half-split RoPE sees HF's rows.
qwen2/qwen3 are converted unpermuted (llama.cpp runs them with NEOX rotary, the half-split).

Parsing a GGUF (``GGUFReader`` walks every metadata array, the vocabulary included) and
dequantizing it take seconds, and a TP start loads the model in several processes; the result
is therefore cached once per file as safetensors (see :mod:`engine.checkpoint.cache`), and the
geometry is read back from that cache's header without opening the GGUF again.
"""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.checkpoint import cache
from engine.checkpoint.formats import GGUF_ARCHITECTURES, CheckpointError
from engine.config import ModelConfig

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name; None when the engine has no such tensor."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of Q/K rows (``[out, in]`` or a ``[out]`` bias)."""
    out = w.shape[0]
    half = out // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _config_dict(reader: Any, path: Path) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(str(path), f"GGUF architecture {arch!r} is not supported; "
                              f"supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in names:
        raise CheckpointError(str(path), f"RoPE scaling ({scaling or 'rope_freqs'}) is not "
                              "supported; only plain RoPE")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(str(path), f"partial RoPE ({rope_dim} of {head_dim} dims) is not "
                              "supported")
    return {
        "architecture": arch,
        "num_layers": int(_field(reader, f"{arch}.block_count")),
        "num_heads": heads,
        "num_kv_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "vocab_size": int(embd.shape[1]),  # GGML order: [hidden, vocab]
        "max_positions": int(_field(reader, f"{arch}.context_length", 2048)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rms_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_embeddings": "output.weight" not in names,
        "qkv_bias": "blk.0.attn_q.bias" in names,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
        "name": str(_field(reader, "general.name", path.stem)),
    }


def _model_config(d: dict[str, Any]) -> ModelConfig:
    fields = {k: v for k, v in d.items() if k != "architecture"}
    return ModelConfig(dtype="float32", **fields)


def _dequantize(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse and dequantize the whole file: (config dict, HF-named float32 arrays)."""
    import gguf
    import numpy as np

    t0 = time.perf_counter()
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise CheckpointError(str(path), f"not a readable GGUF file: {e}") from e
    cfg = _config_dict(reader, path)
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(str(path), f"unsupported GGUF tensor {t.name!r}")
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise CheckpointError(str(path), f"tensor {t.name}: quantization "
                                  f"{t.tensor_type.name} is not supported") from e
        a = np.asarray(a, dtype=np.float32)
        if cfg["architecture"] == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            a = unpermute(a, cfg["num_heads"])
        elif cfg["architecture"] == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            a = unpermute(a, cfg["num_kv_heads"])
        out[name] = np.ascontiguousarray(a)
    logger.info("GGUF %s: parsed and dequantized %d tensors in %.2f s", path.name, len(out),
             time.perf_counter() - t0)
    return cfg, out


def _ensure_cache(path: Path) -> tuple[Path | None, dict[str, Any], dict[str, np.ndarray] | None]:
    """(cache file or None, config dict, arrays when they were just computed)."""
    target = cache.cache_file(path)
    hit = cache.read_metadata(target) if target is not None else None
    if hit is not None:
        return target, json.loads(hit["kvatlas_config"]), None
    with cache.build_lock(target):
        hit = cache.read_metadata(target) if target is not None else None
        if hit is not None:  # another process built it while this one waited
            return target, json.loads(hit["kvatlas_config"]), None
        cfg, arrays = _dequantize(path)
        written = cache.write(target, arrays, {"kvatlas_config": json.dumps(cfg),
                                               "source": str(path)})
        return (target if written else None), cfg, arrays


def config_from_gguf(path: Path) -> ModelConfig:
    """The geometry of the GGUF at ``path`` (from its dequantized cache when present; a miss
    builds the cache now, so the weight load that follows is a memory map)."""
    _, cfg, _ = _ensure_cache(path)
    return _model_config(cfg)


def load_gguf_weights(path: str | Path, config: ModelConfig | None = None
                      ) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of the GGUF at ``path`` (Q/K rows unpermuted)."""
    import torch

    path = Path(path)
    t0 = time.perf_counter()
    target, _, arrays = _ensure_cache(path)
    if arrays is not None:
        weights = {k: torch.from_numpy(v) for k, v in arrays.items()}
    else:
        assert target is not None
        weights = cache.load(target)
    logger.info("GGUF %s: weights loaded in %.2f s (%s)", path.name, time.perf_counter() - t0,
             "dequantized" if arrays is not None else f"cache {target}")
    return weights
