"""Byte tokenizer (lossless on valid UTF-8, streaming never splits a character), chat template,
sampler (greedy, top-k, top-p, seeds) and stop handling."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling import SamplingParams, TextStream, make_generator, sample
from engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, ByteTokenizer, IncrementalDetokenizer

TOK = ByteTokenizer()


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_and_streaming_are_lossless(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return  # lone surrogates are not valid UTF-8 (the HTTP layer refuses them)
    ids = TOK.encode(text)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert TOK.decode(ids) == text
    detok = IncrementalDetokenizer()
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    # no piece ever shows half a character as U+FFFD
    assert "\ufffd" in text or all("\ufffd" not in p for p in pieces)


def test_invalid_bytes_decode_to_replacement_and_specials_are_skipped() -> None:
    assert TOK.decode([0xFF, ord("a"), EOS_ID, PAD_ID]) == "\ufffda"
    with pytest.raises(UnicodeDecodeError):
        TOK.encode_bytes(b"\xc3")


def test_chat_template() -> None:
    text = TOK.apply_chat_template([{"role": "system", "content": "s"},
                                    {"role": "user", "content": [{"type": "text", "text": "u"}]}])
    assert text == "<|system|>\ns\n<|user|>\nu\n<|assistant|>\n"
    for bad in ([], [{"role": "bot", "content": "x"}], [{"role": "user", "content": None}]):
        with pytest.raises(ValueError):
            TOK.apply_chat_template(bad)


def test_sampler() -> None:
    logits = torch.tensor([0.0] * 256 + [8.0, 7.0, 9.0], dtype=torch.float64)  # BOS, EOS, PAD
    logits[10], logits[20], logits[30] = 4.0, 3.9, 3.8
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, greedy, make_generator(0)) == EOS_ID  # BOS and PAD are never produced
    top2 = SamplingParams(temperature=1.0, top_k=2)
    draws = {sample(logits, top2, make_generator(s)) for s in range(200)}
    assert draws == {EOS_ID, 10}
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    assert {sample(logits, nucleus, make_generator(s)) for s in range(50)} == {EOS_ID}
    warm = SamplingParams(temperature=5.0)
    a = [sample(logits, warm, make_generator(7)) for _ in range(3)]
    gen1, gen2 = make_generator(7), make_generator(7)
    assert [sample(logits, warm, gen1) for _ in range(20)] == [sample(logits, warm, gen2)
                                                               for _ in range(20)]
    assert len(set(a)) == 1
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


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
    stream = TextStream(SamplingParams(stop=["END", "éx"]))
    deltas, stopped = _push_all(stream, "abcENabcéyyyEND tail")
    assert stopped and stream.matched == "END"
    assert "".join(deltas) == "abcENabcéyyy" == stream.text
    assert all("END" not in d for d in deltas)
    stream = TextStream(SamplingParams(stop=["zz"]))
    deltas, stopped = _push_all(stream, "abz")
    assert not stopped and "".join(deltas) == "abz"
    stream = TextStream(SamplingParams(stop_token_ids=[7]))
    assert stream.push(ord("a")) == ("a", False)
    assert stream.push(7) == ("", True) and stream.matched == 7
