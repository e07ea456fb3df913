"""Our ids equal transformers' for the same tokenizer files: text with special-token rules,
chat rendered by the model's template and encoded without special tokens (no double BOS).
Generated conversations: system prompts or none, one to seven turns, empty content, non-ASCII
text, template variables."""
from __future__ import annotations

import random
from typing import Any

from tokenization.base import Tokenizer

WORDS = ["the", "KV", "cache", "etcd", "prefill", "décode", "naïve", "Grüße", "東京", "数据",
         "ключ", "🙂", "🚀🚀", "x²", "  ", "\n", "\t", "<tag>", "1234567", "3.14", "'s", "don't",
         "https://example.com/a?b=c", "def f(x):\n    return x", "", "<|im_end|>", "ﬁ", "é"]


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", " ", ", ", ". ", "\n"])
                   for _ in range(rng.randint(0, n)))


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": text(rng, 30)})
    for turn in range(rng.randint(1, 7)):
        role = "user" if turn % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": "" if rng.random() < 0.1 else text(rng, 25)})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": text(rng, 10)})
    return msgs


def test_chat_ids_equal_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    name, ours, ref = pair
    rng = random.Random(13)
    for i in range(220):
        msgs = conversation(rng)
        kwargs = {"enable_thinking": rng.random() < 0.5} if name == "qwen3" else {}
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                       return_dict=False, **kwargs)
        assert ours.encode_chat(msgs, **kwargs) == list(want), (i, msgs)
        assert ours.render_chat(msgs, **kwargs) == ref.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    # the same conversations again: now the pieces come from the prefix cache
    rng = random.Random(13)
    for _ in range(50):
        msgs = conversation(rng)
        kwargs = {"enable_thinking": rng.random() < 0.5} if name == "qwen3" else {}
        assert ours.encode_chat(msgs, **kwargs) == list(ref.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs))


def test_text_ids_equal_transformers(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, ref = pair
    rng = random.Random(7)
    for i in range(220):
        prompt = text(rng, 60) or "x"
        assert ours.encode(prompt, add_special_tokens=True) == ref.encode(prompt), (i, prompt)
        assert ours.encode(prompt, add_special_tokens=False) == ref.encode(
            prompt, add_special_tokens=False), (i, prompt)
        assert list(ours.encode_array(prompt)) == ref.encode(prompt)


def test_no_double_bos_and_end_ids(pair: tuple[str, Tokenizer, Any]) -> None:
    name, ours, ref = pair
    ids = ours.encode_chat([{"role": "user", "content": "Hi"}])
    if ours.bos_id is not None:
        assert ids.count(ours.bos_id) == ids.count(ours.bos_id)  # as the template writes them
        assert ids[:2] != [ours.bos_id, ours.bos_id]
    end_of_turn = ref.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in ours.eos_ids and ref.eos_token_id in ours.eos_ids
    assert ours.vocab_size == len(ref)


def test_streamed_text_equals_decode(pair: tuple[str, Tokenizer, Any]) -> None:
    _, ours, ref = pair
    rng = random.Random(3)
    for _ in range(50):
        ids = ours.encode(text(rng, 40) or "y", add_special_tokens=False)
        detok = ours.detokenizer()
        streamed = "".join(detok.push(i) for i in ids) + detok.flush()
        assert streamed == detok.text == ref.decode(ids, skip_special_tokens=True)
