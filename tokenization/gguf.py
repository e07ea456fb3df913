"""The tokenizer embedded in a GGUF file, as a Hugging Face tokenizer.

A GGUF stores its vocabulary, merges, token kinds, special ids, BOS flag and chat template as
metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``). This builds the byte-level BPE
(``tokenizer.ggml.model == "gpt2"``: GPT-2, SmolLM, Llama 3, Qwen2/3 files) that those describe:

- vocabulary ids as the file lists them; a token spelled outside the byte-level alphabet is
  respelled through it (the file sometimes stores raw text);
- merges as listed; the pre-tokenizer's split pattern chosen by ``tokenizer.ggml.pre`` (the
  default: GPT-2's, built into the ByteLevel pre-tokenizer);
- control tokens (kind 3) added as special, user-defined ones (kind 4) as plain added tokens, so
  they are matched whole in text;
- BOS prepended to encoded text only when ``tokenizer.ggml.add_bos_token`` says so.

Sentencepiece files (``llama``, ``t5``) are refused with a message: give the model's
``tokenizer.json`` directory instead. Reading the metadata takes seconds, so the result is kept as
a tokenizer directory under ``$KVATLAS_CACHE_DIR/tokenizers`` (default ``~/.cache/kvatlas``)
keyed by the file's content (tokenization/derived.py); later loads, of any copy, read that.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenization.base import Tokenizer, TokenizerError
from tokenization.derived import cache_entry, publish_dir
from tokenization.words import byte_alphabet

logger = logging.getLogger(__name__)

VERSION = "1"
"""Bumped when the conversion changes, so cached conversions are rebuilt."""
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
          "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2}
"""Split patterns by ``tokenizer.ggml.pre``; any other name uses GPT-2's (SmolLM's is GPT-2's)."""


def _cache_dir(path: Path) -> Path | None:
    entry = cache_entry(path, VERSION)
    return None if entry is None else entry.parent / "tokenizers" / entry.name


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of the GGUF at ``path``; TokenizerError naming it when it has none this
    can build."""
    from tokenization.hf_dir import load_hf_dir

    cached = _cache_dir(path)
    if cached is not None and (cached / "tokenizer.json").is_file():
        tok = load_hf_dir(cached)
        tok.name = str(path.resolve())
        return tok
    backend, config = _convert(path)
    target = cached
    if target is not None:
        def fill(tmp: Path) -> None:
            backend.save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(config))

        try:
            publish_dir(target, fill)  # False: another process made it first, use its copy
        except OSError as exc:
            logger.warning("could not cache the tokenizer of %s under %s: %s", path, target, exc)
            target = None
    if target is None or not (target / "tokenizer.json").is_file():
        from tokenization.hf import HFTokenizer

        return HFTokenizer(backend, name=str(path.resolve()),
                           chat_template=config.get("chat_template"),
                           special_tokens={k: config.get(k) for k in
                                           ("bos_token", "eos_token", "unk_token", "pad_token")},
                           add_bos=bool(config.get("add_bos_token")))
    tok = load_hf_dir(target)
    tok.name = str(path.resolve())
    return tok


def _convert(path: Path) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json fields) from the file's metadata."""
    import tokenizers
    from gguf import GGUFReader
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

    source = str(path)
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise TokenizerError(source, f"is not a readable GGUF file: {exc}") from None
    fields = reader.fields

    def text(key: str) -> str | None:
        f = fields.get(key)
        return bytes(f.parts[f.data[0]]).decode("utf-8") if f is not None else None

    def number(key: str) -> Any:
        f = fields.get(key)
        return f.parts[f.data[0]][0].item() if f is not None else None

    def strings(key: str) -> list[str]:
        f = fields.get(key)
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data] if f is not None else []

    kind = text("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(source, "the GGUF file holds no tokenizer (tokenizer.ggml.model)")
    if kind != "gpt2":
        raise TokenizerError(source, f"GGUF tokenizer kind {kind!r} is not supported (only "
                             "byte-level BPE, 'gpt2'); give the model's tokenizer.json directory "
                             "instead")
    tokens = strings("tokenizer.ggml.tokens")
    f = fields.get("tokenizer.ggml.token_type")
    kinds = [int(f.parts[i][0]) for i in f.data] if f is not None else [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab = {}
    for i, t in enumerate(tokens):
        spelled = t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8"))
        vocab.setdefault(spelled, i)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                              continuing_subword_prefix="",
                                              end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(text("tokenizer.ggml.pre") or "")
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens spelled outside the alphabet are mislabels of the converter that wrote the
    # file; adding them would grow the vocabulary past the model's embedding
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, kinds)
                                if k == _CONTROL and set(t) <= letters])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, kinds) if k == _USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = number(f"tokenizer.ggml.{key}")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
              "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id"),
              "add_bos_token": bool(number("tokenizer.ggml.add_bos_token")),
              "chat_template": text("tokenizer.chat_template")}
    return backend, config
