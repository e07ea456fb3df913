"""Pins the tiny model's weights and a few greedy tokens to values computed once, so a change of
the weight generator, the math or the platform (torch, BLAS, CPU) that moves them is caught here
rather than as a PD-vs-monolithic mismatch between two machines."""
from __future__ import annotations

import hashlib

import pytest
import torch
from engine_helpers import greedy

from engine.config import get_model_config
from engine.model import Transformer
from engine.runner import build_scheduler, run_to_completion
from engine.scheduler import Request
from tokenization import ByteTokenizer

# computed with torch 2.13.0 (CPU) for get_model_config("tiny", seed=0)
TINY_WEIGHTS_SHA256 = "ebf3ad84d48583d1e7a32debf43b4bdb214947399b8afe777e268e45a48f1446"
GREEDY_16: dict[str, list[int]] = {
    "The quick brown fox jumps over the lazy dog.":
        [190, 56, 206, 241, 145, 34, 67, 98, 142, 58, 237, 77, 203, 190, 56, 206],
    "0123456789 abcdef": [57, 60, 85, 116, 169, 49, 63, 75, 120, 0, 119, 91, 7, 17, 257, 36],
}


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return Transformer(get_model_config("tiny", seed=0))


def weights_digest(m: Transformer) -> str:
    """sha256 of every parameter's bytes in a fixed order (layer by layer)."""
    h = hashlib.sha256()
    tensors: list[torch.Tensor] = [m.embed]
    for layer in m.layers:
        tensors += [layer.attn_norm, layer.mlp_norm, layer.w_gate, layer.w_up, layer.w_down]
        for groups in (layer.wq_groups, layer.wk_groups, layer.wv_groups, layer.wo_groups):
            tensors += groups
    tensors += [m.final_norm, m.lm_head]
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_tiny_weights_are_pinned(tiny: Transformer) -> None:
    assert tiny.embed.dtype == torch.float64
    assert weights_digest(tiny) == TINY_WEIGHTS_SHA256
    # another seed gives other weights (the digest covers what the seed changes)
    assert weights_digest(Transformer(get_model_config("tiny", seed=1))) != TINY_WEIGHTS_SHA256


def test_tiny_greedy_tokens_are_pinned(tiny: Transformer) -> None:
    tok = ByteTokenizer()
    sched = build_scheduler(tiny.cfg, 64, model=tiny)
    reqs = [Request(f"p{i}", tok.encode(text, add_special_tokens=True), greedy(16))
            for i, text in enumerate(GREEDY_16)]
    done = run_to_completion(sched, reqs)
    assert [done[f"p{i}"].output_ids for i in range(len(GREEDY_16))] == list(GREEDY_16.values())
