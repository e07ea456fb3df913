"""The tokenizer contract every engine, router and CLI path uses.

A :class:`Tokenizer` turns what a client sends into the token ids the engine prefills, by the rules
SGLang and vLLM apply (and so the ids the router must hash):

- text (``/generate`` ``text``, OpenAI completion ``prompt`` strings): :meth:`Tokenizer.encode`
  with ``add_special_tokens=True`` -- BOS only where the tokenizer's own rules add it;
- chat messages: :meth:`Tokenizer.render_chat` (the model's jinja template, with
  ``add_generation_prompt=True``), then ``encode(text, add_special_tokens=False)`` -- the template
  writes BOS itself where the model wants one, so encoding with special tokens would double it.
  :meth:`Tokenizer.encode_chat` does both;
- token ids (``input_ids``, a ``prompt`` list of ints) are used as given: no method here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np


class TokenizationError(Exception):
    """Root of this layer's errors: a tokenizer that cannot be loaded, or messages that cannot
    be rendered."""


class TokenizerError(TokenizationError):
    """A tokenizer could not be loaded; ``source`` names the path or name that was asked for."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"tokenizer {source!r}: {reason}")
        self.source = source
        self.reason = reason


class ChatTemplateError(TokenizationError, ValueError):
    """The messages could not be rendered: the template raised (``raise_exception``), or a message
    is malformed (``path`` names it, e.g. ``messages[2].content[1]``). A client error: HTTP 400."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class Detokenizer(ABC):
    """Turns a stream of generated ids into text deltas, never splitting a character."""

    text: str
    """All text produced so far."""

    @abstractmethod
    def push(self, token_id: int) -> str:
        """Feed one id; returns the newly completed text (possibly empty)."""

    @abstractmethod
    def flush(self) -> str:
        """End of stream: whatever is held back (an incomplete character becomes U+FFFD)."""


class Tokenizer(ABC):
    """One model's tokenizer and chat template."""

    kind: str
    """``"byte"`` or ``"hf"``."""
    name: str
    """What it was loaded from, for messages and ``server_info`` (a path, or ``"byte"``)."""
    vocab_size: int
    """Ids are ``0 .. vocab_size - 1`` (added tokens included)."""
    bos_id: int | None
    """The BOS id, or None when the tokenizer has none."""
    eos_ids: frozenset[int]
    """Ids that end generation (the tokenizer's EOS, and a chat model's end-of-turn)."""
    never_ids: frozenset[int]
    """Ids a model must never sample (BOS, PAD of the byte tokenizer); may be empty."""
    max_length: int | None
    """``model_max_length`` of the tokenizer config, when it names a real one."""
    max_token_bytes: int | None = None
    """The most UTF-8 bytes of input one id can stand for, when known (an over-estimate is
    safe): what :meth:`min_tokens` bounds a text's ids with."""

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))`` from the text's length alone, for refusing a
        huge prompt before any tokenizer work (characters <= UTF-8 bytes). 0 when unknown."""
        per = self.max_token_bytes
        return -(-len(text) // per) if per else 0

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """A short stable digest of everything that decides the ids (vocabulary, merges, special
        tokens, rules, chat template): two tokenizers with the same fingerprint give the same
        ids for every request. Instance records carry it, so a router can tell a mismatch."""

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ValueError when it cannot be encoded (a lone surrogate)."""

    @abstractmethod
    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""

    @abstractmethod
    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: list[Any] | None = None,
                    **template_kwargs: Any) -> str:
        """The prompt text of ``messages``; ChatTemplateError when they cannot be rendered."""

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: list[Any] | None = None,
                    **template_kwargs: Any) -> list[int]:
        """The ids an engine prefills for ``messages``: rendered, then encoded without special
        tokens (the template wrote them)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def encode_array(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """:meth:`encode` as a ``<u4`` array: what block hashing takes without a per-id copy."""
        return np.asarray(self.encode(text, add_special_tokens), dtype="<u4")

    def encode_chat_array(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, tools: list[Any] | None = None,
                          **template_kwargs: Any) -> np.ndarray:
        """:meth:`encode_chat` as a ``<u4`` array."""
        return np.asarray(self.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                           tools=tools, **template_kwargs), dtype="<u4")

    @abstractmethod
    def detokenizer(self) -> Detokenizer:
        """A fresh incremental detokenizer for one output stream."""


def message_text(content: Any, where: str) -> str:
    """The text of one message's ``content``: a string as is, None as "" (an assistant turn of
    tool calls only), a list of ``{"type": "text", "text"}`` parts joined with newlines (vLLM's
    rule for templates that take string content). Any other part (an image, audio) is a
    ChatTemplateError naming it: these models read text only."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            if not isinstance(part, dict):
                raise ChatTemplateError(at, f"a content part must be an object, got "
                                            f"{type(part).__name__}")
            kind = part.get("type")
            if kind != "text":
                raise ChatTemplateError(at, f"content parts of type {kind!r} are not supported: "
                                            "this model reads text only (type 'text')")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(at + ".text", "must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ChatTemplateError(where, f"must be a string or a list of text parts, got "
                                   f"{type(content).__name__}")
