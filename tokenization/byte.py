"""The byte tokenizer of kvatlas's seeded reference models (``tiny``, ``bench``): UTF-8 bytes are
ids 0-255, then BOS (256), EOS (257), PAD (258).

Encoding valid UTF-8 text and decoding the ids gives back the same text (lossless). Decoding
arbitrary model output replaces invalid byte sequences with U+FFFD; the detokenizer holds back an
incomplete multi-byte character until its last byte arrives, so streamed text never splits a
character.

Chat template (the model has no learned roles; this is plain text the byte model sees)::

    <|system|>\\n{system content}\\n      (one block per message, in order)
    <|user|>\\n{user content}\\n
    <|assistant|>\\n{assistant content}\\n
    <|assistant|>\\n                       (generation prompt, when asked for)

A BOS id starts every prompt: text encoded with special tokens, and every chat (a text template
cannot write id 256, so :meth:`ByteTokenizer.encode_chat` adds it: the one difference from the
rule of ``tokenization.base``).
"""
from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tokenization.base import ChatTemplateError, Detokenizer, Tokenizer
from tokenization.messages import check_messages

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
CHAT_ROLES = ("system", "user", "assistant")
_TEMPLATE_VERSION = "byte-v1: <|role|>\\n{content}\\n per message; <|assistant|>\\n; BOS first"


class ByteTokenizer(Tokenizer):
    """Stateless byte tokenizer (one shared instance is fine)."""

    kind = "byte"
    name = "byte"
    vocab_size = VOCAB_SIZE
    bos_id = BOS_ID
    eos_ids = frozenset({EOS_ID})
    never_ids = frozenset({BOS_ID, PAD_ID})
    max_length = None
    max_token_bytes = 1
    """One id stands for at most one UTF-8 byte."""

    def min_tokens(self, text: str) -> int:
        return len(text) + 1  # BOS, then at least one id a character

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(_TEMPLATE_VERSION.encode()).hexdigest()[:16]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_special_tokens else ids

    def encode_array(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        # No per-byte Python work: the router encodes every text prompt with this.
        data = text.encode("utf-8")
        start = 1 if add_special_tokens else 0
        ids = np.empty(len(data) + start, dtype="<u4")
        if start:
            ids[0] = BOS_ID
        ids[start:] = np.frombuffer(data, dtype=np.uint8)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of the byte ids; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: list[Any] | None = None,
                    **template_kwargs: Any) -> str:
        """The prompt text of ``messages`` (see the module docstring); ``tools`` and other
        template variables mean nothing to this template and are ignored."""
        parts: list[str] = []
        for i, msg in enumerate(check_messages(messages)):
            if msg["role"] not in CHAT_ROLES:
                raise ChatTemplateError(f"messages[{i}].role",
                                        f"must be one of {list(CHAT_ROLES)}, got {msg['role']!r}")
            parts.append(f"<|{msg['role']}|>\n{msg['content']}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: list[Any] | None = None,
                    **template_kwargs: Any) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=True)

    def encode_chat_array(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, tools: list[Any] | None = None,
                          **template_kwargs: Any) -> np.ndarray:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode_array(text, add_special_tokens=True)

    def detokenizer(self) -> Detokenizer:
        return ByteDetokenizer()


class ByteDetokenizer(Detokenizer):
    """Turns a stream of byte ids into text deltas without splitting multi-byte characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        delta = self._decoder.decode(bytes((token_id,)))
        self.text += delta
        return delta

    def flush(self) -> str:
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta
