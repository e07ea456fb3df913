"""The two real tokenizers the project's test assets ship, loaded once per session: ours and
transformers' own of the same files (the reference every id is compared with)."""
from __future__ import annotations

from typing import Any

import pytest

from tokenization import assets, load_tokenizer
from tokenization.base import Tokenizer

NAMES = ("qwen3", "smollm2-135m")


def reference(name: str) -> Any:
    """transformers' tokenizer of the same files (a GGUF through its own converter)."""
    from transformers import AutoTokenizer

    if name == "qwen3":
        return AutoTokenizer.from_pretrained(str(assets.qwen3_tokenizer_dir()))
    gguf = assets.smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="session", params=NAMES)
def pair(request: pytest.FixtureRequest) -> tuple[str, Tokenizer, Any]:
    """(name, ours, transformers')."""
    return request.param, load_tokenizer(request.param), reference(request.param)
