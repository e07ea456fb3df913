"""Loading a tokenizer from what a user names: ``byte``, a model alias of an installed asset,
a directory of Hugging Face tokenizer files, or a ``.gguf`` file. One error, TokenizerError,
naming the path and what was expected."""
from __future__ import annotations

import logging
from pathlib import Path

from tokenization.base import Tokenizer, TokenizerError
from tokenization.hf_dir import load_hf_dir

logger = logging.getLogger(__name__)

BYTE = "byte"


def load_tokenizer(source: str) -> Tokenizer:
    """The tokenizer ``source`` names; TokenizerError (its message names ``source``) when it
    cannot be loaded."""
    from tokenization import assets
    from tokenization.byte import ByteTokenizer

    if source == BYTE:
        return ByteTokenizer()
    resolved = assets.tokenizer_path(source)
    path = Path(resolved).expanduser() if resolved else Path(source).expanduser()
    try:
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return load_hf_dir(path)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _gguf(ggufs[0])
            raise TokenizerError(source, "directory has no tokenizer.json"
                                 + (f" and {len(ggufs)} .gguf files (name one)" if ggufs
                                    else " and no .gguf"))
        if path.is_file():
            if path.suffix == ".gguf":
                return _gguf(path)
            if path.name == "tokenizer.json":
                return load_hf_dir(path.parent)
            raise TokenizerError(source, "not a tokenizer: give a directory with tokenizer.json, "
                                 "a .gguf file, 'byte' or a model alias "
                                 f"({', '.join(sorted(assets.ALIASES))})")
    except OSError as exc:
        raise TokenizerError(source, f"cannot be read: {exc.strerror or exc}") from None
    raise TokenizerError(source, "no such file or directory (give a directory with "
                         "tokenizer.json, a .gguf file, 'byte' or a model alias: "
                         f"{', '.join(sorted(assets.ALIASES))})")


def can_load(source: str) -> bool:
    """Whether ``source`` names a tokenizer this host has, without loading it: ``byte``, an
    alias of an installed asset, or a path that exists."""
    from tokenization import assets

    if source == BYTE or assets.is_known(source):
        return True
    try:
        return Path(source).expanduser().exists()
    except OSError:
        return False


def _gguf(path: Path) -> Tokenizer:
    from tokenization.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(path)
