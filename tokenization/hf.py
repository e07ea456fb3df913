"""Hugging Face tokenizers (``tokenizers``' Rust BPE/Unigram, no torch) with the model's chat
template, loaded from a directory (``tokenizer.json`` + ``tokenizer_config.json`` and/or
``chat_template.jinja``; ``generation_config.json`` for extra end ids) or built from a GGUF file
(``tokenization.gguf``).

Prefix caching. A chat template puts a special token (``<|im_start|>``, ``<|im_end|>``) between
turns, and a tokenizer splits its input at every added token *before* it normalizes or
pre-tokenizes anything: the ids of a text are the concatenation of the ids of the pieces between
added tokens, each encoded alone. So the pieces are cached (a bounded LRU): a conversation's
earlier turns, or a shared system prompt, are looked up rather than encoded again, and only the
new turn is. This holds exactly when every added token is matched on the raw text
(``normalized=False``) and strips nothing around it, and when no normalizer or pre-tokenizer
acts on the text's first position only (``Prepend``, ``Metaspace``); a tokenizer that breaks any
of these is encoded whole, uncached.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers
from tokenizers.decoders import DecodeStream

from tokenization.base import Detokenizer, Tokenizer
from tokenization.chat import ChatTemplate
from tokenization.words import WordEncoder

END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
               "<end_of_turn>", "<|eom_id|>")
"""Special tokens that end a chat model's turn: each one the vocabulary holds as an added
special token is an end id, beside the tokenizer's EOS (what SGLang and vLLM stop on through
the model's generation config)."""
CACHE_PIECES = 8192
"""Pieces (text between added tokens) kept in the prefix cache."""
CACHE_CHARS = 32 << 20
"""Characters kept in the prefix cache, all pieces together."""
_FIRST_POSITION = ("Prepend", "Metaspace")


def _ids_array(ids: Sequence[int]) -> np.ndarray:
    return np.asarray(ids, dtype="<u4")


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` with its special tokens and chat template."""

    kind = "hf"

    def __init__(self, backend: tokenizers.Tokenizer, *, name: str,
                 chat_template: str | None, special_tokens: Mapping[str, str | None],
                 extra_eos_ids: Iterable[int] = (), max_length: int | None = None,
                 add_bos: bool = False) -> None:
        """``special_tokens``: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` (the
        template sees them); ``add_bos``: the tokenizer config asks for BOS at the start of
        encoded text and the backend's post-processor does not add it itself."""
        self.backend = backend
        self.name = name
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self._template = ChatTemplate(chat_template, special_tokens) if chat_template else None
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self.bos_id = self._id(special_tokens.get("bos_token"))
        eos = {self._id(special_tokens.get("eos_token")), *extra_eos_ids}
        added = backend.get_added_tokens_decoder()
        specials = {t.content: i for i, t in added.items() if t.special}
        eos.update(specials[t] for t in END_OF_TURN if t in specials)
        self.eos_ids = frozenset(i for i in eos if i is not None)
        self.never_ids = frozenset()
        self.max_length = max_length
        longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
        # A normalizer may compose characters (NFC: up to 3 UTF-8 bytes into 1): bound that.
        self.max_token_bytes = longest * (3 if backend.normalizer is not None else 1)
        self._add_bos = add_bos and self.bos_id is not None
        self._fingerprint: str | None = None
        self._lock = threading.Lock()
        self._pieces: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_chars = 0
        self._words = WordEncoder.build(backend)
        """A piece not in the cache is encoded word by word when the pipeline allows
        (tokenization/words.py): the Rust call's fixed cost is most of a short turn's."""
        self._splitter, added_ids = self._piece_splitter(added)
        self._added_arrays = {t: _ids_array([i]) for t, i in added_ids.items()}
        wrap = self._special_wrap() if self._splitter is not None else None
        self._wrap = None if wrap is None else (_ids_array(wrap[0]), _ids_array(wrap[1]))

    # --- what the cache relies on ---------------------------------------------------------------

    def _piece_splitter(self, added: Mapping[int, tokenizers.AddedToken]
                        ) -> tuple[re.Pattern[str] | None, dict[str, int]]:
        if any(t.normalized or t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return None, {}
        doc = json.loads(self.backend.to_str())
        rules = json.dumps([doc.get("normalizer"), doc.get("pre_tokenizer")])
        if any(f'"{kind}"' in rules for kind in _FIRST_POSITION):
            return None, {}
        ids = {t.content: i for i, t in added.items()}
        if not ids:
            return re.compile("(?!)"), ids  # nothing to split on: one piece
        # longest first: at each position the longest added token wins, as in the Rust matcher
        alts = "|".join(re.escape(c) for c in sorted(ids, key=len, reverse=True))
        return re.compile(f"({alts})"), ids

    def _special_wrap(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(ids before, ids after) the post-processor puts around a text's ids, when it only
        wraps them (checked on two probes); None: not a plain wrap, encode text whole."""
        found = set()
        for probe in ("a", "hello world 1"):
            body = self.backend.encode(probe, add_special_tokens=False).ids
            full = self.backend.encode(probe, add_special_tokens=True).ids
            for i in range(len(full) - len(body) + 1):
                if full[i:i + len(body)] == body:
                    found.add((tuple(full[:i]), tuple(full[i + len(body):])))
                    break
            else:
                return None
        return found.pop() if len(found) == 1 else None

    def _id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token else None

    # --- Tokenizer ------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256(self.backend.to_str().encode())
            h.update(b"\0" + (self.chat_template or "").encode())
            h.update(b"\0" + json.dumps([self.special_tokens, sorted(self.eos_ids),
                                         self._add_bos], sort_keys=True).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode_array(text, add_special_tokens).tolist()  # type: ignore[no-any-return]

    def encode_array(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        try:
            ids = self._encode(text, add_special_tokens)
        except TypeError:
            # the Rust side refuses a str it cannot turn into UTF-8 (a lone surrogate) with a
            # bare TypeError: raise what the rules say (UnicodeEncodeError, a ValueError)
            text.encode("utf-8")
            raise
        if add_special_tokens and self._add_bos and (not len(ids) or ids[0] != self.bos_id):
            ids = np.concatenate([_ids_array([self.bos_id]), ids])  # type: ignore[list-item]
        return ids

    def encode_chat_array(self, messages: Sequence[Mapping[str, Any]], *,
                          add_generation_prompt: bool = True, tools: list[Any] | None = None,
                          **template_kwargs: Any) -> np.ndarray:
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, **template_kwargs)
        return self.encode_array(text, add_special_tokens=False)

    def _encode(self, text: str, add_special_tokens: bool) -> np.ndarray:
        if self._splitter is None or (add_special_tokens and self._wrap is None):
            return _ids_array(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        chunks = self._pieces_of(text)
        if add_special_tokens:
            before, after = self._wrap  # type: ignore[misc]
            chunks = [before, *chunks, after]
        return np.concatenate(chunks) if chunks else _ids_array([])

    def _pieces_of(self, text: str) -> list[np.ndarray]:
        """The ids of ``text`` as chunks: one per added token and per piece between them, the
        pieces from the cache where it has them (one lock for all the lookups)."""
        parts = self._splitter.split(text)  # type: ignore[union-attr]
        chunks: list[np.ndarray | None] = []
        missing: list[tuple[int, str]] = []
        added = self._added_arrays
        pieces = self._pieces
        with self._lock:
            for k, part in enumerate(parts):
                if k % 2:  # an added token
                    chunks.append(added[part])
                elif part:
                    ids = pieces.get(part)
                    if ids is None:
                        missing.append((len(chunks), part))
                    else:
                        pieces.move_to_end(part)
                    chunks.append(ids)
        words = self._words
        for at, part in missing:  # encoded outside the lock: other requests go on
            ids = words.encode(part) if words is not None else None
            if ids is None:
                ids = _ids_array(self.backend.encode(part, add_special_tokens=False).ids)
            ids.flags.writeable = False  # shared by every request that meets this piece
            self._remember(part, ids)
            chunks[at] = ids
        return chunks  # type: ignore[return-value]

    def _remember(self, part: str, ids: np.ndarray) -> None:
        if len(part) > CACHE_CHARS // 4:
            return
        with self._lock:
            if part in self._pieces:
                return
            self._pieces[part] = ids
            self._cached_chars += len(part)
            while len(self._pieces) > CACHE_PIECES or self._cached_chars > CACHE_CHARS:
                old, _ = self._pieces.popitem(last=False)
                self._cached_chars -= len(old)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, tools: list[Any] | None = None,
                    **template_kwargs: Any) -> str:
        if self._template is None:
            from tokenization.base import ChatTemplateError
            raise ChatTemplateError("messages", f"tokenizer {self.name} has no chat template; "
                                                "send text or token ids instead")
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, **template_kwargs)

    def detokenizer(self) -> Detokenizer:
        return HFDetokenizer(self)


class HFDetokenizer(Detokenizer):
    """Incremental decoding (``tokenizers.decoders.DecodeStream``: it holds back ids until they
    make whole characters); special tokens are skipped."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []
        self.text = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        try:
            delta = self._stream.step(self._tok.backend, token_id)
        except Exception:  # noqa: BLE001 - an id the vocabulary lacks: decoded whole at flush
            delta = None
        if not delta:
            return ""
        self.text += delta
        return delta

    def flush(self) -> str:
        full = self._tok.decode(self._ids)
        if not full.startswith(self.text):
            return ""
        delta = full[len(self.text):]
        self.text += delta
        return delta
