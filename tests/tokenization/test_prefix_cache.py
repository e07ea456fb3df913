"""The piece cache gives the ids the tokenizer gives the whole text, whatever was cached before
(hypothesis: texts cut by special tokens, encoded in any order), and stays bounded."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import hf, load_tokenizer

QWEN = load_tokenizer("qwen3")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>", "<tool_call>"]
pieces = st.lists(st.one_of(st.text(max_size=40), st.sampled_from(SPECIALS)), max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(pieces, min_size=1, max_size=4))
def test_cached_ids_equal_whole_text_ids(texts: list[list[str]]) -> None:
    assert QWEN._splitter is not None  # the cached path is the one under test
    for parts in texts:
        text = "".join(parts)
        try:
            want = QWEN.backend.encode(text, add_special_tokens=False).ids
        except UnicodeEncodeError:
            continue
        assert QWEN.encode(text, add_special_tokens=False) == want
        assert QWEN.encode(text) == QWEN.backend.encode(text).ids


def test_cache_is_bounded(monkeypatch: object) -> None:
    tok = load_tokenizer("qwen3")
    import pytest
    mp = pytest.MonkeyPatch()
    mp.setattr(hf, "CACHE_PIECES", 10)
    try:
        for i in range(50):
            tok.encode(f"<|im_start|>user {i}<|im_end|>", add_special_tokens=False)
        assert len(tok._pieces) <= 10
    finally:
        mp.undo()
