"""kv_aware credits a matched block by the cache tier holding it: a device block 1.0, a host
block 0.75, a disk block 0.25 (flags). The index is a real ``BlockTable`` with media."""
from __future__ import annotations

import random

import pytest
from router_stubs import encode_text

from index.table import BlockTable
from index.tiers import TierMatch, TierWeights, tier_of
from router.breaker import CircuitBreaker
from router.config import RouterConfig
from router.kv_aware import KvAware
from router.policy import RouteContext
from router.workers import Worker

TEXT = "<|system|>\nA long shared document. " + "kv cache tiers " * 40


def workers(n: int) -> list[Worker]:
    return [Worker(f"p{i}", "prefill", f"http://127.0.0.1:{9000 + i}", CircuitBreaker())
            for i in range(n)]


def policy(table: BlockTable, **kw: object) -> KvAware:
    config = RouterConfig(**kw)  # type: ignore[arg-type]
    return KvAware(config, lambda h, m: table.lookup(h), random.Random(1),
                   tier_lookup=lambda h, m: table.lookup_tiers(h))


def test_media_map_to_tiers() -> None:
    assert [tier_of(m) for m in (None, "GPU", "cuda", "CPU", "CPU_PINNED", "DISK", "LOCAL_FILE",
                                 "SSD")] == ["device", "device", "device", "host", "host",
                                             "disk", "disk", "disk"]
    assert TierMatch(4, 2, 2).credit(TierWeights()) == 4 + 1.5 + 0.5
    with pytest.raises(ValueError, match="host hit weight"):
        TierWeights(host=1.5)


def test_a_longer_host_match_beats_a_shorter_device_one_only_by_its_weight() -> None:
    kv0 = policy(BlockTable())
    hashes = RouteContext(encode_text(TEXT)).hashes(kv0.hasher, kv0.seed)
    n = len(hashes)
    assert n >= 12
    table = BlockTable()
    table.apply_add("p0", hashes[:6])                       # 6 device blocks
    table.apply_add("p1", hashes[:10], "CPU_PINNED")         # 10 host blocks: credit 7.5
    kv = policy(table)
    ws = workers(2)
    choice = kv.select(ws, RouteContext(encode_text(TEXT)))
    assert choice.worker.instance_id == "p1"
    cand = {c["instance_id"]: c for c in choice.candidates}
    assert cand["p1"]["index_tiers"] == {"device": 0, "host": 10, "disk": 0}
    assert cand["p1"]["credited_blocks"] == 7.5 and cand["p0"]["credited_blocks"] == 6
    assert cand["p1"]["cost"] == pytest.approx((n - 7.5) * 2.0)
    # The same on disk credits 2.5 blocks: the 6 device blocks win.
    table = BlockTable()
    table.apply_add("p0", hashes[:6])
    table.apply_add("p1", hashes[:10], "DISK")
    assert policy(table).select(workers(2), RouteContext(encode_text(TEXT))).worker.instance_id \
        == "p0"
    # Weights are flags: a host block worth as much as a device block.
    table = BlockTable()
    table.apply_add("p0", hashes[:10])
    table.apply_add("p1", hashes[:10], "CPU")
    kv = policy(table, tier_weights=TierWeights(host=1.0))
    cand = {c["instance_id"]: c for c in kv.select(
        workers(2), RouteContext(encode_text(TEXT))).candidates}
    assert cand["p0"]["cost"] == cand["p1"]["cost"]


def test_a_prefix_split_across_tiers_is_credited_block_by_block() -> None:
    kv0 = policy(BlockTable())
    hashes = RouteContext(encode_text(TEXT)).hashes(kv0.hasher, kv0.seed)
    table = BlockTable()
    table.apply_add("p0", hashes[:4])
    table.apply_add("p0", hashes[4:8], "CPU")
    table.apply_add("p0", hashes[8:10], "DISK")
    choice = policy(table).select(workers(1), RouteContext(encode_text(TEXT)))
    assert choice.indexed_blocks == 10
    cand = choice.candidates[0]
    assert cand["index_tiers"] == {"device": 4, "host": 4, "disk": 2}
    assert cand["credited_blocks"] == 4 + 3 + 0.5


def test_the_readmes_worked_example() -> None:
    """docs/router.md, "Worked example": p1's 16 host blocks beat p0's 12 device blocks under unseen load."""
    from router.engine_load import EngineLoad

    tokens = list(range(1000, 1000 + 20 * 16))
    probe = policy(BlockTable())
    hashes = RouteContext(tokens).hashes(probe.hasher, probe.seed)
    assert len(hashes) == 20
    table = BlockTable()
    table.apply_add("p0", hashes[:12])
    table.apply_add("p1", hashes[:16], "CPU")
    kv = policy(table)
    kv.mean_work = 6.0
    ws = workers(3)
    now = kv._clock()
    kv.work.add("p0", 8)
    ws[0].load = 1
    ws[0].engine = EngineLoad(queue=3, running=2, kv_usage=0.5, at=now)
    ws[2].engine = EngineLoad(queue=1, running=0, kv_usage=0.1, at=now)
    choice = kv.select(ws, RouteContext(tokens))
    cost = {c["instance_id"]: (c["credited_blocks"], c["load_blocks"], c["cost"])
            for c in choice.candidates}
    assert cost == {"p0": (12, 26.0, 42.0), "p1": (12.0, 0.0, 16.0), "p2": (0, 6.0, 46.0)}
    assert choice.worker.instance_id == "p1"
