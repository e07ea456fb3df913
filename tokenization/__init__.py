"""Tokenizers and chat templates: the one layer that turns what a client sends into the token ids
an engine prefills, used by the engine, the router and the CLI alike (so their ids, and the block
hashes made of them, agree). The rules are in ``tokenization.base``; the kinds are the byte
tokenizer of the seeded reference models (``byte``) and Hugging Face tokenizers (``hf``: a
``tokenizer.json`` directory or a GGUF file). Imports no torch and nothing of the other layers.
"""
from __future__ import annotations

from typing import Any

from tokenization.assets import ALIASES, SMOLLM2_NAME, canonical_model
from tokenization.base import (
    ChatTemplateError,
    Detokenizer,
    TokenizationError,
    Tokenizer,
    TokenizerError,
)
from tokenization.byte import ByteTokenizer
from tokenization.loading import BYTE, can_load, load_tokenizer

__all__ = ["ALIASES", "BYTE", "SMOLLM2_NAME", "ByteTokenizer", "ChatTemplateError", "Detokenizer",
           "TokenizationError", "Tokenizer", "TokenizerError", "can_load", "canonical_model",
           "load_tokenizer",
           "tokenizer_record"]


def tokenizer_record(tok: Tokenizer) -> dict[str, Any]:
    """What an instance record (``record.tokenizer``) and ``/server_info`` say of an engine's
    tokenizer: ``source`` (``"byte"`` or the path it was loaded from: a router on the same host
    can load it) and ``fingerprint`` (a router compares it with its own)."""
    return {"source": tok.name, "fingerprint": tok.fingerprint, "kind": tok.kind}
