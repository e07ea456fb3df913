"""The engine's output path over the byte tokenizer (``tokenization``): a request's text stream
is lossless on valid UTF-8 and never splits a character; the sampler (greedy, top-k, top-p,
seeds) never produces the tokenizer's ``never_ids``; stop handling."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import SamplingParams, TextStream, banned_ids, make_generator, sample
from tokenization import ByteTokenizer

TOK = ByteTokenizer()
BOS_ID = TOK.bos_id
[EOS_ID] = TOK.eos_ids
BANNED = banned_ids(TOK, TOK.vocab_size)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_and_streaming_are_lossless(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates are not valid UTF-8 (the HTTP layer refuses them)
    ids = TOK.encode(text, add_special_tokens=True)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    stream = TextStream(SamplingParams(max_new_tokens=len(ids) + 1), TOK)
    pieces = [stream.push(i)[0] for i in ids] + [stream.finish()]
    assert "".join(pieces) == text == stream.text
    # no piece ever shows half a character as U+FFFD
    assert "\ufffd" in text or all("\ufffd" not in p for p in pieces)


def test_eos_stops_unless_ignored() -> None:
    assert TextStream(SamplingParams(), TOK).push(EOS_ID) == ("", True)
    stream = TextStream(SamplingParams(ignore_eos=True), TOK)
    assert stream.push(EOS_ID) == ("", False) and stream.push(ord("a")) == ("a", False)


def test_sampler() -> None:
    logits = torch.tensor([0.0] * 256 + [8.0, 7.0, 9.0], dtype=torch.float64)  # BOS, EOS, PAD
    logits[10], logits[20], logits[30] = 4.0, 3.9, 3.8
    greedy = SamplingParams(temperature=0.0)
    # BOS and PAD (the tokenizer's never_ids) are never produced
    assert sample(logits, greedy, make_generator(0), BANNED) == EOS_ID
    assert sample(logits, greedy, make_generator(0)) == 258  # nothing banned: PAD's 9.0 wins
    top2 = SamplingParams(temperature=1.0, top_k=2)
    draws = {sample(logits, top2, make_generator(s), BANNED) for s in range(200)}
    assert draws == {EOS_ID, 10}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    assert {sample(logits, nucleus, make_generator(s), BANNED) for s in range(50)} == {EOS_ID}
    warm = SamplingParams(temperature=5.0)
    a = [sample(logits, warm, make_generator(7), BANNED) for _ in range(3)]
    gen1, gen2 = make_generator(7), make_generator(7)
    assert [sample(logits, warm, gen1, BANNED) for _ in range(20)] == [
        sample(logits, warm, gen2, BANNED) for _ in range(20)]
    assert len(set(a)) == 1
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_ids_past_the_tokenizer_are_banned() -> None:
    """A checkpoint's embedding padded past its tokenizer: those ids decode to nothing, and
    are never sampled."""
    banned = banned_ids(TOK, TOK.vocab_size + 5)
    assert set(banned.tolist()) == set(TOK.never_ids) | set(range(TOK.vocab_size,
                                                                   TOK.vocab_size + 5))
    logits = torch.zeros(TOK.vocab_size + 5, dtype=torch.float64)
    logits[-1], logits[42] = 9.0, 1.0
    assert sample(logits, SamplingParams(temperature=0.0), make_generator(0), banned) == 42


def _push_all(stream: TextStream, text: str) -> tuple[list[str], bool]:
    out, stopped = [], False
    for b in text.encode():
        delta, stopped = stream.push(b)
        out.append(delta)
        if stopped:
            break
    if not stopped:
        out.append(stream.finish())
    return out, stopped


def test_stop_strings_are_held_back_and_trimmed() -> None:
    stream = TextStream(SamplingParams(stop=["END", "éx"]), TOK)
    deltas, stopped = _push_all(stream, "abcENabcéyyyEND tail")
    assert stopped and stream.matched == "END"
    assert "".join(deltas) == "abcENabcéyyy" == stream.text
    assert all("END" not in d for d in deltas)
    stream = TextStream(SamplingParams(stop=["zz"]), TOK)
    deltas, stopped = _push_all(stream, "abz")
    assert not stopped and "".join(deltas) == "abz"
    stream = TextStream(SamplingParams(stop_token_ids=[7]), TOK)
    assert stream.push(ord("a")) == ("a", False)
    assert stream.push(7) == ("", True) and stream.matched == 7
