"""router/route.py: one routing decision per request (model resolved once, prompt hashed once by
the shared memoized hasher, a typed Decision that dispatch executes and /debug/route prints),
and request parsing that does not load the policies."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from router.config import RouterConfig
from router.kv_aware import KvAware
from router.prompt_hashes import CHUNK_BLOCKS, shared_hasher
from router.requests import GENERATE, parse_request
from router.route import Decision, decide, route_context
from router.state import RouterState

ROOT = Path(__file__).resolve().parents[2]


def test_request_parsing_does_not_import_the_policies() -> None:
    """The parser hashes large bodies through router.prompt_hashes, not the policy module."""
    code = ("import sys, router.requests; "
            "print(sorted(m for m in sys.modules if m in "
            "('router.policy', 'router.kv_aware', 'router.policies', 'router.state')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_large_bodys_hashes_are_the_policys_memo() -> None:
    """The parser's thread (block_size given: a large body) and kv_aware hash with the same
    memoized hasher: a prompt the parser hashed is all memo hits for the policy."""
    hasher = shared_hasher(16)
    assert KvAware(RouterConfig(block_size=16)).hasher is hasher
    chunks = 3
    ids = np.random.default_rng(11).integers(0, 50_000, 16 * CHUNK_BLOCKS * chunks).tolist()
    misses, hits = hasher.misses, hasher.hits
    parsed = parse_request(GENERATE, json.dumps({"input_ids": ids}).encode(), 64, None, 16)
    assert parsed.hashes is not None and len(parsed.hashes[1]) == CHUNK_BLOCKS * chunks
    assert hasher.misses - misses == chunks  # the parser filled the memo
    seed, pre = parsed.hashes
    assert hasher.hashes(parsed.prompts[0], seed) == pre
    assert hasher.hits - hits == chunks and hasher.misses - misses == chunks


def _state() -> RouterState:
    return RouterState(RouterConfig(prefill=[("http://127.0.0.1:1", None),
                                             ("http://127.0.0.1:2", None)],
                                    decode=["http://127.0.0.1:3"], model="tiny",
                                    block_size=16))


def test_decide_resolves_the_model_once_and_is_what_debug_route_prints() -> None:
    state = _state()
    ids = list(range(1, 16 * 5 + 3))
    parsed = parse_request(GENERATE, json.dumps({"input_ids": ids}).encode(), 64,
                           tokenizers=state.tokenizers)
    ctx = route_context(parsed)
    # Settled by the parser, once: the body names none, so the router's --model.
    assert parsed.model is None and parsed.route_model == "tiny" and ctx.model == "tiny"
    decision = decide(state, ctx)
    assert isinstance(decision, Decision)
    assert decision.model == "tiny" and decision.policy == "kv_aware"
    p = decision.pair.prefill
    assert p.prompt_blocks == 5 and p.hashes == ctx.hashes(state.prefill_policy.hasher,
                                                           state.prefill_policy.seed)
    shown = decision.describe(state)
    assert shown["prefill"]["instance_id"] == p.worker.instance_id
    assert shown["decode"]["instance_id"] == decision.pair.decode.worker.instance_id
    assert shown["model"] == "tiny" and shown["prompt_blocks"] == 5
    assert shown["policy"] == {"prefill": "kv_aware", "decode": "power_of_two"}
    assert {c["instance_id"] for c in shown["candidates"]} == {
        w.instance_id for w in state.pools.pool("prefill")}
    header = json.loads(decision.explain(state))
    assert header["prefill"] == p.worker.instance_id and header["prompt_blocks"] == 5
    # A retry decides again on the same context: the prompt is not hashed again.
    hashed = ctx.hashes(state.prefill_policy.hasher, state.prefill_policy.seed)
    again = decide(state, ctx, exclude={p.worker.instance_id})
    assert again.pair.prefill.worker is not p.worker
    assert again.pair.prefill.hashes is hashed


def test_a_request_naming_no_model_is_routed_as_the_one_model_served() -> None:
    """Without --model: the one model the pools serve, else none (the index's only one is
    asked once it is loaded); a named alias is routed as its canonical model."""
    state = RouterState(RouterConfig(prefill=[("http://127.0.0.1:1", None)],
                                     decode=["http://127.0.0.1:3"], block_size=16))
    assert state.tokenizers.for_request(None)[0] is None
    state.pools.add("prefill", "http://127.0.0.1:4", model="m1")
    assert state.default_model() == "m1"
    raw = json.dumps({"input_ids": [1, 2, 3]}).encode()
    assert parse_request(GENERATE, raw, 64, tokenizers=state.tokenizers).route_model == "m1"
    state.pools.add("prefill", "http://127.0.0.1:5", model="m2")
    assert state.default_model() is None
    named = parse_request(GENERATE, json.dumps({"input_ids": [1], "model": "m2"}).encode(), 64,
                          tokenizers=state.tokenizers)
    assert named.model == named.route_model == "m2"
