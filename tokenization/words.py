"""Byte-level BPE text encoded word by word, each word's ids cached.

Why: a byte-level BPE tokenizer (GPT-2, SmolLM, Llama 3, Qwen) cuts its input into words with
one regex before BPE runs, and BPE never merges across two words, so a text's ids are its words'
ids one after the other. Words repeat far more than texts do: a new chat turn is new text made
of words seen before. The Rust ``Tokenizer.encode`` call costs ~40 us for a 40-token turn, most
of it fixed (an ``Encoding`` with offsets, type ids and masks is built); splitting with the same
regex here and looking the words up costs ~13 us (``bench/router.py --tokenizer smollm2-135m
--chat`` routes such turns). A word not seen yet is BPE'd by the tokenizer's own model
(``model.tokenize``), so the ids are the model's, not a reimplementation's.

Rules, stated up front (``WordEncoder.build`` returns None for any pipeline outside them, and
the caller encodes with the Rust call as before):
- the model is ``BPE`` without dropout;
- the normalizer is none, or NFC, and then only text that is already NFC takes this path (NFC
  leaves it as it is, whichever Unicode version each side knows);
- the pre-tokenizer is ``ByteLevel`` with its GPT-2 regex and no prefix space, or a
  ``Sequence`` of ``Split`` by a regex (``Isolated``, not inverted) then ``ByteLevel`` without
  its regex and without a prefix space;
- the split covers the whole text (no character falls between two matches), checked per text.
Two checks back the rules: a probe corpus (scripts, digits, whitespace runs, contractions,
emoji) must encode identically both ways before the encoder is used, and one word-encoded
text in ``VERIFY_EVERY`` is encoded by the Rust call too: any difference turns the word path
off for good, with a warning.
"""
from __future__ import annotations

import json
import logging
import unicodedata
from itertools import chain
from typing import Any

import numpy as np
import regex
import tokenizers

logger = logging.getLogger(__name__)

GPT2_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
"""``ByteLevel``'s own split when ``use_regex`` is on (the Rust crate's pattern)."""
MAX_WORDS = 200_000
"""Words kept; past it the cache starts again (frequent words come straight back)."""
MAX_CHARS = 1 << 16
"""Longer texts take the Rust call: per word the dictionary path is slower than Rust's loop,
and the fixed cost it saves is small beside a long text's."""
VERIFY_EVERY = 64
"""One word-encoded text in this many is compared with the Rust call."""
PROBES = (
    "Hello world! It's 2026; they'll say we've   done it.\n\n  Indented\tline\r\n",
    "Grüße aus Köln — naïve café, ÆØÅ, ß and İstanbul.",
    "東京は日本の首都です。  한국어 텍스트 و العربية",
    "numbers 1234567 3.14159 -42 0x1F 1e10, emoji 🙂👍🏽 and symbols @#$%^&*()[]{}",
    "    def f(x):\n        return x  # comment\n\n\n",
    "trailing spaces   ", " leading", "'S 'LL 'd THE END", "a\u00a0b\u2009c\u3000d",
)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level spelling (what ByteLevel feeds BPE): printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    spelled = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


_BYTE_CHARS = byte_alphabet()


def _split_pattern(pre: dict[str, Any] | None) -> str | None:
    """The regex the pre-tokenizer ``pre`` (its JSON) splits words with, when it is one the
    rules cover; else None."""
    if pre is None:
        return None
    kind = pre.get("type")
    if kind == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return GPT2_PATTERN
    if kind != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated"
            or split.get("invert") or byte_level.get("type") != "ByteLevel"
            or byte_level.get("add_prefix_space") or byte_level.get("use_regex", True)):
        return None
    pattern = split.get("pattern") or {}
    return pattern.get("Regex")


class WordEncoder:
    """Ids of text, word by word, for one byte-level BPE ``tokenizers.Tokenizer``."""

    def __init__(self, backend: tokenizers.Tokenizer, pattern: str, nfc: bool) -> None:
        self.backend = backend
        self._split = regex.compile(pattern).findall
        self._model = backend.model
        self._nfc = nfc
        self._words: dict[str, tuple[int, ...]] = {}
        self._count = 0
        self.enabled = True

    @classmethod
    def build(cls, backend: tokenizers.Tokenizer) -> WordEncoder | None:
        """The encoder of ``backend``, or None: its pipeline is outside the rules above, or the
        probes encode differently."""
        doc = json.loads(backend.to_str())
        model, norm = doc.get("model") or {}, doc.get("normalizer")
        if model.get("type") != "BPE" or model.get("dropout"):
            return None
        if norm is not None and norm.get("type") != "NFC":
            return None
        pattern = _split_pattern(doc.get("pre_tokenizer"))
        if pattern is None:
            return None
        try:
            enc = cls(backend, pattern, nfc=norm is not None)
        except regex.error:
            return None  # a pattern Python's regex reads differently: not used
        for probe in PROBES:
            ids = enc._words_of(probe)
            if ids is None or ids.tolist() != backend.encode(probe, add_special_tokens=False).ids:
                logger.info("word-by-word encoding not used: probe %r differs", probe)
                return None
        enc._words.clear()
        return enc

    def encode(self, text: str) -> np.ndarray | None:
        """``text``'s ids without special tokens, or None: this text takes the Rust call."""
        if not self.enabled or len(text) > MAX_CHARS:
            return None
        ids = self._words_of(text)
        if ids is None:
            return None
        self._count += 1
        if self._count % VERIFY_EVERY == 0:
            want = self.backend.encode(text, add_special_tokens=False).ids
            if ids.tolist() != want:
                self.enabled = False
                logger.warning("word-by-word encoding differs from the tokenizer on a %d-char "
                               "text; turned off (every text now takes the Rust call)",
                               len(text))
                return None
        return ids

    def _words_of(self, text: str) -> np.ndarray | None:
        if self._nfc and not unicodedata.is_normalized("NFC", text):
            return None
        words = self._split(text)
        if sum(map(len, words)) != len(text):
            return None  # characters between matches: the Rust split keeps them, findall not
        cache = self._words
        chunks = list(map(cache.get, words))
        if None in chunks:  # (a tuple never equals None)
            for i, ids in enumerate(chunks):
                if ids is None:
                    chunks[i] = self._learn(words[i])
        return np.fromiter(chain.from_iterable(chunks), dtype="<u4")

    def _learn(self, word: str) -> tuple[int, ...]:
        """``word``'s ids from the tokenizer's own BPE model, cached."""
        mapped = "".join([_BYTE_CHARS[b] for b in word.encode("utf-8")])
        ids = tuple(t.id for t in self._model.tokenize(mapped))
        cache = self._words
        if len(cache) >= MAX_WORDS:
            cache.clear()
        cache[word] = ids
        return ids
