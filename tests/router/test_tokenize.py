"""The router's tokenization must produce the engine's prompt ids, so block hashes agree."""
from __future__ import annotations

from typing import Any

import pytest

from engine.config import get_model_config
from engine.protocol import parse_chat, parse_completion, parse_generate
from router.requests import parse_chat as r_chat
from router.requests import parse_completion as r_completion
from router.requests import parse_generate as r_generate

LIMIT = 1 << 20


def as_lists(prompts: list[Any]) -> list[list[int]]:
    return [[int(t) for t in p] for p in prompts]
MODEL = get_model_config("tiny")

GENERATE_BODIES: list[dict[str, Any]] = [
    {"text": "hello"}, {"text": "héllo wörld ✓ 漢字"}, {"input_ids": [5, 6, 7, 8]},
    {"text": ["one", "two"]}, {"input_ids": [[1, 2], [3]]},
]
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"prompt": "the quick brown fox"}, {"prompt": [10, 20, 30]}, {"prompt": ["single"]},
]
CHAT_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]}]},
]


@pytest.mark.parametrize("body", GENERATE_BODIES)
def test_generate_ids_match_engine(body: dict[str, Any]) -> None:
    inputs, _, _ = parse_generate(body, MODEL)
    assert as_lists(r_generate(body, LIMIT).prompts) == [i.prompt for i in inputs]


@pytest.mark.parametrize("body", COMPLETION_BODIES)
def test_completion_ids_match_engine(body: dict[str, Any]) -> None:
    gen, _ = parse_completion(body, MODEL)
    assert as_lists(r_completion(body, LIMIT).prompts) == [gen.prompt]


@pytest.mark.parametrize("body", CHAT_BODIES)
def test_chat_ids_match_engine(body: dict[str, Any]) -> None:
    gen, _ = parse_chat(body, MODEL)
    assert as_lists(r_chat(body, LIMIT).prompts) == [gen.prompt]


def test_block_hashes_match_engine_prefix_cache() -> None:
    import torch

    from engine.kv_pool import KVPool
    from engine.prefix_cache import PrefixCache
    from index.hashing import block_hashes
    text = "shared system prompt " * 10
    gen, _ = parse_completion({"prompt": text}, MODEL)
    cache = PrefixCache(KVPool(1, 1, 4, torch.float32, num_pages=4, page_size=16))
    ours = r_completion({"prompt": text}, LIMIT).prompts[0]
    assert block_hashes(ours, 16) == cache.hashes(gen.prompt)
    assert len(cache.hashes(gen.prompt)) == (len(text.encode()) + 1) // 16  # BOS counts
