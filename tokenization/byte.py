"""Byte-level tokenizer: UTF-8 bytes are ids 0-255, then BOS (256), EOS (257), PAD (258).

Encoding valid UTF-8 text and decoding the ids gives back the same text (lossless). Decoding
arbitrary model output replaces invalid byte sequences with U+FFFD; the incremental decoder holds
back an incomplete multi-byte character until its last byte arrives, so streamed text never
splits a character.

Chat template (the model has no learned roles; this is plain text the byte model sees)::

    <|system|>\\n{system content}\\n      (one block per message, in order)
    <|user|>\\n{user content}\\n
    <|assistant|>\\n{assistant content}\\n
    <|assistant|>\\n                       (generation prompt, appended last)

Messages' ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts.
A BOS id starts every prompt built from text.
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
SPECIAL_IDS = frozenset({BOS_ID, EOS_ID, PAD_ID})
CHAT_ROLES = ("system", "user", "assistant")


class ByteTokenizer:
    """Stateless byte tokenizer (one shared instance is fine)."""

    bos_id = BOS_ID
    eos_id = EOS_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_bos else ids

    def encode_bytes(self, data: bytes, add_bos: bool = True) -> list[int]:
        """Encode raw bytes; raises UnicodeDecodeError when they are not valid UTF-8."""
        data.decode("utf-8")
        return [BOS_ID, *data] if add_bos else list(data)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids; special ids are skipped, invalid UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict[str, object]]) -> str:
        """The prompt text for ``messages`` (see the module docstring); raises ValueError."""
        if not messages:
            raise ValueError("messages must be a non-empty list")
        parts: list[str] = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise ValueError(f"messages[{i}] must be an object")
            role = msg.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}")
            parts.append(f"<|{role}|>\n{_content_text(msg.get('content'), i)}\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


def _content_text(content: object, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ValueError(f"messages[{i}].content parts must be {{'type': 'text', 'text': str}}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of text parts")


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas without splitting multi-byte characters."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        """Feed one id; returns the newly completed text (possibly empty)."""
        if not 0 <= token_id < 256:
            return ""
        delta = self._decoder.decode(bytes((token_id,)))
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: an incomplete trailing character becomes U+FFFD."""
        delta = self._decoder.decode(b"", final=True)
        self.text += delta
        return delta
