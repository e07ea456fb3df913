"""A Hugging Face tokenizer directory as a :class:`~tokenization.hf.HFTokenizer`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenization.base import Tokenizer, TokenizerError

_HUGE = 10 ** 9
"""``model_max_length`` past this is the tokenizer library's "no limit" placeholder."""


def _token(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TokenizerError(str(path), f"is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(str(path), "must hold a JSON object")
    return doc


def load_hf_dir(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer directory: ``tokenizer.json`` (required), the chat template from
    ``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``; special
    tokens and ``model_max_length`` from ``tokenizer_config.json``; end ids from
    ``generation_config.json``."""
    import tokenizers

    from tokenization.hf import HFTokenizer

    try:
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - the Rust loader raises plain Exception
        raise TokenizerError(str(path / "tokenizer.json"), f"is not a tokenizer: {exc}") from None
    config = _json(path / "tokenizer_config.json")
    template = _template(path, config)
    specials = {k: _token(config.get(k)) for k in ("bos_token", "eos_token", "unk_token",
                                                    "pad_token")}
    extra = _json(path / "generation_config.json").get("eos_token_id")
    extra_ids = [extra] if isinstance(extra, int) else [i for i in extra or [] if isinstance(i, int)]
    max_len = config.get("model_max_length")
    max_len = max_len if isinstance(max_len, int) and 0 < max_len < _HUGE else None
    return HFTokenizer(backend, name=str(path.resolve()), chat_template=template,
                       special_tokens=specials, extra_eos_ids=extra_ids, max_length=max_len,
                       add_bos=config.get("add_bos_token") is True)


def _template(path: Path, config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = _json(path / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(value, list):  # named templates: the "default" one serves chat
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None
