"""The routing-quality bench's trace generators and offline bounds (bench/_routing_trace.py)."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    # bench/ is not a package, and putting it on sys.path would shadow the ``index`` package
    # with bench/index.py: load the module from its file.
    path = ROOT / "bench" / "_routing_trace.py"
    spec = importlib.util.spec_from_file_location("_routing_trace", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_routing_trace"] = mod
    spec.loader.exec_module(mod)
    return mod


rt = _load()


def test_synthetic_trace_is_seeded_and_multi_turn() -> None:
    a = rt.synthetic_trace(seed=3, conversations=8, groups=3)
    assert a == rt.synthetic_trace(seed=3, conversations=8, groups=3)
    assert a != rt.synthetic_trace(seed=4, conversations=8, groups=3)
    last: dict[str, str] = {}
    turns = 0
    for r in a:
        assert len(rt.prompt_tokens(r.text)) + r.max_new_tokens <= rt.MAX_POSITIONS
        if r.session in last:
            # each turn is the previous turn's prompt, its reply and a new user message
            assert r.text.startswith(last[r.session]) and len(r.text) > len(last[r.session])
            turns += 1
        last[r.session] = r.text
    assert turns >= len(a) // 2
    # conversations of one group share the system prompt; other groups do not
    firsts = {}
    for r in a:
        firsts.setdefault(r.session, r.text.split("<|user|>")[0])
    systems = set(firsts.values())
    assert len(systems) == 3
    # interleaved: some conversation's turns are not consecutive
    sessions = [r.session for r in a]
    assert any(sessions[i] != sessions[i + 1] and sessions[i] in sessions[i + 2:]
               for i in range(len(sessions) - 2))


def test_mooncake_trace_maps_shared_hash_ids_to_shared_prefixes(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1536, "output_length": 40, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 9]},
            {"timestamp": 9, "input_length": 512, "output_length": 3, "hash_ids": [7]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = rt.mooncake_trace(path, block_chars=32, max_new_tokens=6)
    assert [len(r.text) for r in reqs] == [96, round(1100 * 32 / 512), 32]
    assert reqs[0].text[:64] == reqs[1].text[:64]
    assert reqs[0].text[64:68] != reqs[1].text[64:68]
    assert reqs[2].text[:8] != reqs[0].text[:8]
    assert [r.max_new_tokens for r in reqs] == [6, 2, 3]
    assert rt.mooncake_trace(path, block_chars=32, limit=2)[1] == reqs[1]


def test_bounds_on_a_hand_checked_trace() -> None:
    text = "x" * 50  # BOS + 50 bytes = 51 tokens: 3 full blocks, all usable on a repeat
    reqs = [rt.Req(0, text, 4), rt.Req(1, "y" * 50, 4), rt.Req(2, text, 4)]
    assert rt.infinite_bound(reqs) == 48
    assert rt.belady_bound(reqs, capacity_blocks=3) == 48  # keeps x's blocks, bypasses y's
    assert rt.belady_bound(reqs, capacity_blocks=2) == 32
    assert rt.simulate(reqs, 2, 3, "round_robin") == 48  # x, y, x -> instances 0, 1, 0
    assert rt.simulate(reqs, 3, 3, "round_robin") == 0  # x, y, x -> instances 0, 1, 2
    assert rt.simulate(reqs, 2, 2, "round_robin") == 32  # LRU kept x's head blocks
    assert rt.simulate(reqs, 3, 3, "greedy") == 48


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_bounds_every_simulated_router(seed: int) -> None:
    reqs = rt.synthetic_trace(seed=seed, conversations=10, groups=3, active=5, turns=3)
    prev = 0
    for cap in (20, 60, 150, 400):
        oracle = rt.belady_bound(reqs, 3 * cap)
        assert oracle >= prev  # more capacity never lowers the optimum
        prev = oracle
        for rule in ("round_robin", "greedy"):
            assert rt.simulate(reqs, 3, cap, rule) <= oracle
    assert rt.belady_bound(reqs, 10 ** 6) >= rt.infinite_bound(reqs) > 0


def test_oracle_bounds_random_routings() -> None:
    """The Belady bound holds for any routing, not just the two simulated rules."""
    reqs = rt.synthetic_trace(seed=5, conversations=8, groups=2, active=4, turns=3)
    blocks = rt.request_blocks(reqs)
    cap, n = 40, 3
    oracle = rt.belady_bound(reqs, n * cap)
    rng = random.Random(0)
    for _ in range(5):
        caches: list[list[int]] = [[] for _ in range(n)]  # LRU lists, most recent last
        hits = 0
        for r, bl in zip(reqs, blocks):
            c = caches[rng.randrange(n)]
            u = rt.usable(bl, len(rt.prompt_tokens(r.text)))
            m = 0
            while m < u and bl[m] in c:
                m += 1
            hits += m * rt.BLOCK
            for h in reversed(bl):
                if h in c:
                    c.remove(h)
                c.append(h)
            del c[:max(0, len(c) - cap)]
        assert hits <= oracle


def test_the_committed_mooncake_trace_loads_and_shares_prefixes() -> None:
    """bench/data's copy of Mooncake's FAST'25 trace: 2,000 requests, prefixes shared."""
    path = ROOT / "bench" / "data" / "mooncake_fast25_first2000.jsonl"
    reqs = rt.mooncake_trace(path)
    assert len(reqs) == 2000
    total_blocks = sum(len(r.text) for r in reqs) // rt.BLOCK
    assert rt.distinct_blocks(reqs) < 0.8 * total_blocks  # prefixes are shared
    assert rt.infinite_bound(reqs) > 0


def test_rounds_trace_takes_every_turn_t_before_any_turn_t_plus_one() -> None:
    reqs = rt.rounds_trace(seed=1, conversations=6, turns=3)
    assert reqs == rt.rounds_trace(seed=1, conversations=6, turns=3)
    assert len(reqs) == 18
    seen: dict[str, int] = {}
    for k, r in enumerate(reqs):
        assert k // 6 == seen.get(r.session, -1) + 1  # round k // 6 is this session's next turn
        seen[r.session] = k // 6
        assert len(rt.prompt_tokens(r.text)) + r.max_new_tokens <= rt.MAX_POSITIONS
    # No prefix is shared between conversations beyond the first block's template words.
    firsts = [rt.request_blocks([r], rt.BLOCK)[0] for r in reqs[:6]]
    for i in range(6):
        for j in range(i + 1, 6):
            assert firsts[i][1:2] != firsts[j][1:2]


def test_hot_prefix_trace_shares_exactly_its_prefix() -> None:
    reqs = rt.hot_prefix_trace(seed=2, requests=16)
    blocks = rt.request_blocks(reqs, rt.BLOCK)
    assert all(b[:32] == blocks[0][:32] for b in blocks)
    assert len({b[32] for b in blocks}) == 16  # the 33rd block is each request's own
    # Sticky routing (one LRU holding everything) caches the prefix of all but the first.
    assert rt.simulate(reqs, 1, 10_000, "greedy") == 15 * 32 * rt.BLOCK
