"""Policies on plain workers: load-only ones, and kv_aware with a real BlockTable as the index."""
from __future__ import annotations

import random
from collections import Counter

from router_stubs import encode_text

from index.hashing import block_hashes
from index.table import BlockTable
from router.breaker import CircuitBreaker
from router.config import RouterConfig
from router.kv_aware import KvAware
from router.policy import PowerOfTwo, RoundRobin, RouteContext
from router.predictions import Prediction
from router.workers import Worker


def workers(n: int, role: str = "prefill") -> list[Worker]:
    return [Worker(f"p{i}", role, f"http://127.0.0.1:{9000 + i}", CircuitBreaker())
            for i in range(n)]


def test_round_robin_cycles() -> None:
    ws = workers(3)
    rr = RoundRobin()
    picks = [rr.select(ws, RouteContext()).worker.instance_id for _ in range(6)]
    assert picks == ["p0", "p1", "p2", "p0", "p1", "p2"]


def test_power_of_two_prefers_less_loaded() -> None:
    ws = workers(2)
    ws[0].load = 5
    p2 = PowerOfTwo(random.Random(1))
    assert {p2.select(ws, RouteContext()).worker.instance_id for _ in range(20)} == {"p1"}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_kv(table: BlockTable | None = None, **kw: object) -> tuple[KvAware, Clock]:
    clock = Clock()
    kw.setdefault("overlap_weight", 1.0)  # the costs below are worked out at weight 1
    cfg = RouterConfig(**kw)  # type: ignore[arg-type]
    lookup = (lambda hashes, model: table.lookup(hashes)) if table is not None else None
    return KvAware(cfg, lookup, random.Random(7), clock), clock


PROMPT = encode_text("You are a helpful assistant. " * 20 + "Question one?")


def test_kv_aware_prefers_longest_prefix_and_reports_candidates() -> None:
    hashes = block_hashes(PROMPT, 16)
    table = BlockTable()
    table.apply_add("p1", hashes[:10])
    table.apply_add("p2", hashes[:3])
    kv, _ = make_kv(table)
    ws = workers(3)
    choice = kv.select(ws, RouteContext(PROMPT))
    assert choice.worker.instance_id == "p1" and choice.matched_blocks == 10
    cands = {c["instance_id"]: c for c in choice.candidates}
    n = len(hashes)
    assert cands["p1"]["cost"] == n - 10 and cands["p2"]["matched_blocks"] == 3
    assert cands["p0"]["cost"] == n and choice.candidates[0]["instance_id"] == "p1"


def test_kv_aware_trades_overlap_against_load() -> None:
    hashes = block_hashes(PROMPT, 16)
    table = BlockTable()
    table.apply_add("p1", hashes[:4])
    kv, _ = make_kv(table)
    ws = workers(2)
    ws[1].load = 3
    assert kv.select(ws, RouteContext(PROMPT)).worker.instance_id == "p1"  # 4 blocks saved > 3
    ws[1].load = 6
    assert kv.select(ws, RouteContext(PROMPT)).worker.instance_id == "p0"  # too busy now


def test_kv_aware_tie_goes_to_less_loaded() -> None:
    kv, _ = make_kv(BlockTable())
    ws = workers(2)
    ws[0].load = 1
    short = encode_text("hi")  # no full block: every cost is just the load
    ws[1].load = 0
    assert kv.select(ws, RouteContext(short)).worker.instance_id == "p1"
    # Equal cost from different mixes of blocks and load: the less loaded wins.
    hashes = block_hashes(PROMPT, 16)
    table = BlockTable()
    table.apply_add("p0", hashes[:2])
    kv, _ = make_kv(table)
    ws[0].load, ws[1].load = 2, 0
    choice = kv.select(ws, RouteContext(PROMPT))
    assert choice.candidates[0]["cost"] == choice.candidates[1]["cost"]
    assert choice.worker.instance_id == "p1"


def test_prediction_makes_a_burst_stick_then_expires() -> None:
    kv, clock = make_kv(BlockTable(), prediction_ttl=120.0)
    ws = workers(4)
    first = kv.select(ws, RouteContext(PROMPT))
    kv.on_routed(first)
    first.worker.load += 1
    for _ in range(5):
        c = kv.select(ws, RouteContext(PROMPT))
        assert c.worker is first.worker and c.matched_blocks == len(c.hashes)
        kv.on_routed(c)
        c.worker.load += 1
    for w in ws:
        w.load = 0
    clock.t += 121
    c = kv.select(ws, RouteContext(PROMPT))
    assert c.matched_blocks == 0 and len(kv.prediction) == 0


def test_prediction_memory_is_bounded() -> None:
    pred = Prediction(ttl=1000, max_blocks=100, clock=lambda: 0.0)
    for i in range(50):
        pred.add("p0", list(range(i * 10, i * 10 + 10)))
    assert len(pred) <= 100
    # The newest survive, the oldest went first.
    assert pred.lookup(list(range(490, 500))) == {"p0": 10}
    assert pred.lookup([0]) == {}


def test_repeated_prompt_entries_are_bounded_too() -> None:
    # A hot prompt adds no new blocks, only entries: they must not pile up for the whole TTL.
    pred = Prediction(ttl=1000, max_blocks=100, clock=lambda: 0.0)
    shared = list(range(50))
    for i in range(1000):
        pred.add("p0", shared + [1000 + i % 3])
    queue = pred._queues["p0"]
    assert sum(len(e[2]) for e in queue) <= 200
    assert pred.lookup(shared + [1000 + 999 % 3]) == {"p0": 51}
    # The same prompt again refreshes its entry in place, and keeps the blocks alive.
    first = pred.add("p1", shared)
    second = pred.add("p1", list(shared))
    assert [e[1] for e in pred._queues["p1"]] == [first] == [second]
    assert pred.lookup(shared) == {"p1": 50}


def test_prediction_refresh_keeps_block() -> None:
    clock = Clock()
    pred = Prediction(ttl=10, clock=clock)
    pred.add("p0", [1, 2])
    clock.t = 8
    pred.add("p0", [1, 2])
    clock.t = 12  # the first add expired, the refresh has not
    assert pred.lookup([1, 2]) == {"p0": 2}
    clock.t = 19
    assert pred.lookup([1, 2]) == {}


def test_temperature_samples_mostly_the_best() -> None:
    hashes = block_hashes(PROMPT, 16)
    table = BlockTable()
    table.apply_add("p1", hashes)
    kv, _ = make_kv(table, temperature=0.2)
    ws = workers(3)
    counts = Counter(kv.select(ws, RouteContext(PROMPT)).worker.instance_id for _ in range(400))
    assert counts["p1"] > 300 and counts["p0"] + counts["p2"] > 0
