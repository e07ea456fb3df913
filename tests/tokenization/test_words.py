"""Word-by-word encoding (tokenization/words.py) against the real tokenizers' own Rust encode:
the ids must be the same for any text, or the encoder must decline the text."""
from __future__ import annotations

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import load_tokenizer
from tokenization.words import VERIFY_EVERY, WordEncoder

NAMES = ("qwen3", "smollm2-135m")

# Text made of what chat turns carry: words of several scripts, digits, punctuation, runs of
# whitespace, contractions, emoji, and now and then any code point at all.
_WORDS = st.sampled_from(["hello", "Hello", " world", "it's", "THEY'LL", "1234567", "3.14",
                          "東京", "Grüße", "café", "e\u0301", "🙂", "👍🏽", "  ", "\n\n", "\t",
                          " \r\n", "\u00a0", "def", "(x):", "#", "...", "—", "'s"])
TEXT = st.lists(st.one_of(_WORDS, st.text(max_size=6)), max_size=30).map("".join)


@pytest.fixture(scope="module", params=NAMES)
def encoder(request: pytest.FixtureRequest) -> WordEncoder:
    enc = WordEncoder.build(load_tokenizer(request.param).backend)
    assert enc is not None, f"{request.param}: a byte-level BPE the rules cover got no encoder"
    return enc


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_ids_equal_the_rust_encode(encoder: WordEncoder, text: str) -> None:
    try:
        want = encoder.backend.encode(text, add_special_tokens=False).ids
    except TypeError:  # a lone surrogate: the Rust side refuses it, so must we
        with pytest.raises(UnicodeEncodeError):
            encoder.encode(text)
        return
    got = encoder.encode(text)
    if got is not None:
        assert got.tolist() == want, text
    assert encoder.enabled


def test_text_that_is_not_nfc_takes_the_rust_call() -> None:
    backend = load_tokenizer("qwen3").backend  # its normalizer is NFC
    enc = WordEncoder.build(backend)
    assert enc is not None
    assert enc.encode("cafe\u0301") is None
    assert enc.encode("caf\u00e9") is not None


def test_a_pipeline_outside_the_rules_gets_no_encoder() -> None:
    backend = tokenizers.Tokenizer.from_str(load_tokenizer("smollm2-135m").backend.to_str())
    backend.normalizer = tokenizers.normalizers.Lowercase()
    assert WordEncoder.build(backend) is None
    backend.normalizer = None
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert WordEncoder.build(backend) is None


def test_a_difference_turns_the_word_path_off() -> None:
    enc = WordEncoder.build(load_tokenizer("smollm2-135m").backend)
    assert enc is not None
    assert enc.encode(" hello") is not None
    enc._words[" hello"] = (1, 2, 3)  # a wrong entry: the periodic check must catch it
    answers = [enc.encode(" hello") for _ in range(VERIFY_EVERY)]
    assert not enc.enabled, "the check never compared a word-encoded text with the Rust call"
    assert answers[-1] is None
    assert enc.encode("anything") is None
