"""SmolLM2-135M-Instruct through real PD processes (``kvatlas engine serve --model smollm2-135m``,
gloo ranks, ZMQ KV transfer) for prefill/decode TP (1, 1), (3, 1) and (1, 3): the decode's greedy
tokens equal the one-process engine's for chat prompts sent one after another, and a second
chat sharing the system prompt hits the prefill's prefix cache. TP 2 does not divide the
model's 3 KV heads: a start-up error naming the choices."""
from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest
from pd_helpers import new_room, pd_body
from pd_procs import ROOT, Proc

from engine.checkpoint import resolve_model
from engine.runner import build_scheduler, load_model, run_to_completion
from engine.sampling import SamplingParams
from engine.scheduler import Request
from tokenization import load_tokenizer

pytestmark = pytest.mark.timeout(240)

MODEL = "smollm2-135m"
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary color.",
             "What is two plus two?", "Which planet is called the red planet?"]
MAX_NEW = 12
COMBOS = [("1", "1"), ("3", "1"), ("1", "3")]


def _prompts() -> list[list[int]]:
    tok = load_tokenizer(MODEL)
    return [tok.encode_chat([{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": q}]) for q in QUESTIONS]


_REFERENCE: list[list[int]] = []


def reference() -> list[list[int]]:
    """Greedy tokens of the one-process engine, each prompt on its own."""
    if not _REFERENCE:
        spec = resolve_model(MODEL)
        model, tok = load_model(spec)
        for i, ids in enumerate(_prompts()):
            sched = build_scheduler(spec.config, num_pages=256, model=model, tokenizer=tok)
            req = Request(f"r{i}", ids, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0,
                                                       ignore_eos=True))
            _REFERENCE.append(run_to_completion(sched, [req])[req.rid].output_ids)
    return _REFERENCE


@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: f"P{c[0]}-D{c[1]}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Proc, Proc]]:
    p_tp, d_tp = request.param
    prefill = Proc("prefill", "--tp", p_tp, model=MODEL)
    decode = Proc("decode", "--tp", d_tp, model=MODEL)
    try:
        prefill.wait_ready(180)
        decode.wait_ready(180)
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


async def test_pd_greedy_equals_monolithic(pair: tuple[Proc, Proc]) -> None:
    prefill, decode = pair
    want = reference()
    cached = []
    async with aiohttp.ClientSession() as s:
        for ids, expected in zip(_prompts(), want):
            body = pd_body(ids, MAX_NEW, prefill.bport, room=new_room())
            # both halves at once, as the router sends them
            pr, dr = await asyncio.gather(s.post(prefill.url + "/generate", json=body),
                                          s.post(decode.url + "/generate", json=body))
            pbody, dbody = await pr.json(), await dr.json()
            assert (pr.status, dr.status) == (200, 200), (pbody, dbody)
            assert dbody["output_ids"] == expected
            cached.append(pbody["meta_info"]["cached_tokens"])
    # the later chats share the system prompt's blocks with the first
    assert cached[0] == 0 and all(c >= 16 for c in cached[1:]), cached


def test_tp_that_does_not_divide_kv_heads_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", "prefill",
                          "--model", MODEL, "--tp", "2", "--port", "1", "--bootstrap-port", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "3 KV heads" in out.stderr and "1 or 3" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
