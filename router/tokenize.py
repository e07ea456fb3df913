"""The router's copy of the engine's byte tokenizer and chat template.

Why a copy: the router may not import ``engine/`` (layering), yet its block hashes must be the
very hashes the prefill's prefix cache publishes, or every index lookup misses and kv_aware
silently degrades to load balancing. So this module must produce exactly the token ids the
engine prefills (``engine/tokenizer.py`` + ``engine/protocol.py``):

- text (``/generate`` ``text``, OpenAI ``prompt`` strings, rendered chat) becomes
  ``[BOS=256] + list(utf8 bytes)``: the engine prepends BOS to every prompt built from text;
- token ids (``input_ids``, OpenAI ``prompt`` as a list of ints) are used as given, no BOS;
- chat messages are rendered with the engine's template, then encoded as text (with BOS).

``tests/router/test_tokenize.py`` checks these against the engine's own tokenizer.
"""
from __future__ import annotations

from typing import Any

import numpy as np

BOS_ID = 256


def encode_text(text: str) -> np.ndarray:
    """Token ids (uint32 array) the engine prefills for ``text``; UnicodeEncodeError on lone
    surrogates. An array, not a list: block hashing takes it without a per-token copy."""
    data = text.encode("utf-8")
    ids = np.empty(len(data) + 1, dtype="<u4")
    ids[0] = BOS_ID
    ids[1:] = np.frombuffer(data, dtype=np.uint8)
    return ids


def chat_text(messages: list[Any]) -> str:
    """The engine's chat template: ``<|role|>\\n{content}\\n`` per message, then the generation
    prompt ``<|assistant|>\\n``. Raises ValueError on a malformed message."""
    if not messages:
        raise ValueError("must be a non-empty list of {role, content} objects")
    parts: list[str] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        parts.append(f"<|{role}|>\n{_content_text(msg.get('content'), i)}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def _content_text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError(f"messages[{i}].content parts must be objects")
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str):
                texts.append(text)
        return "".join(texts)
    raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
