"""Canaries: after a prefill served a prompt, the router checks a little later that the block
index shows that prompt's first block on it. Unit tests run the real ``Canaries`` against a real
``MemoryBlockIndex`` with an injected clock; the integration test runs the router's background
checks against real etcd, a real block writer and the router's mirror."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from etcd_block_index import EtcdBlockIndex
from etcd_instances import wait_for
from memory_index import MemoryBlockIndex
from router_stubs import encode_text

from index.hashing import block_hashes
from router.breaker import CircuitBreaker
from router.canary import CANARY_BLOCKS, MAX_PENDING, Canaries
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.workers import ETCD, Worker

SYSTEM = "You are kvatlas, a careful assistant. Answer briefly and cite sources. " * 4


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Setup:
    def __init__(self, **kw: Any) -> None:
        self.config = RouterConfig(**{"canary_delay": 2.0, "canary_interval": 1.0, **kw})
        self.metrics = RouterMetrics()
        self.index = MemoryBlockIndex("tiny")
        self.clock = Clock()
        self.live = True
        self.ignored: set[str] = set()
        self.canaries = Canaries(self.config, self.metrics, self.lookup, lambda: self.live,
                                 lambda iid: iid in self.ignored, self.clock, lambda: 1.7e9)
        self.worker = Worker("p0", "prefill", "http://127.0.0.1:8000", CircuitBreaker(),
                             source=ETCD, model="tiny")

    def lookup(self, hashes: Sequence[int], model: str | None) -> dict[str, int]:
        return self.index.match("tiny", hashes)

    def serve(self, prompt: str, worker: Worker | None = None) -> list[int]:
        tokens = encode_text(prompt)
        self.canaries.served(worker or self.worker, tokens, "tiny")
        return block_hashes(tokens, 16)

    def metric(self, result: str) -> list[str]:
        return [line for line in self.metrics.render().decode().splitlines()
                if line.startswith(f'kvatlas_router_canary_total{{instance="p0",'
                                   f'result="{result}"}}')]


async def test_hit_when_the_index_shows_the_prompt_and_miss_when_not() -> None:
    s = Setup()
    hashes = s.serve(SYSTEM + "one")
    await s.index.add("p0", None, hashes)
    s.clock.t += 1.9
    assert s.canaries.check() == 0  # not due yet
    s.clock.t += 0.2
    assert s.canaries.check() == 1
    st = s.canaries.stats("p0")
    assert (st.hits, st.misses, st.consecutive_misses, st.last_checked) == (1, 0, 0, 1.7e9)
    for i in range(2):
        s.serve(SYSTEM.lower() + f"never stored {i}")  # not in the index
        s.clock.t += 2.5
        assert s.canaries.check() == 0  # not found: one more look a delay later
        s.clock.t += 2.0
        assert s.canaries.check() == 1
    assert (st.hits, st.misses, st.consecutive_misses) == (1, 2, 2)
    assert st.requests_with_blocks == 3
    assert s.metric("hit") == ['kvatlas_router_canary_total{instance="p0",result="hit"} 1.0']
    assert s.metric("miss") == ['kvatlas_router_canary_total{instance="p0",result="miss"} 2.0']
    # A hit ends the run of misses.
    s.serve(SYSTEM + "one")
    s.clock.t += 2.5
    s.canaries.check()
    assert (st.hits, st.consecutive_misses) == (2, 0)
    assert st.describe() == {"hits": 2, "misses": 2, "consecutive_misses": 0,
                             "last_checked": 1.7e9}


async def test_at_most_one_per_interval_and_a_few_pending() -> None:
    s = Setup()
    for _ in range(5):
        s.serve(SYSTEM + "burst")
    assert len(s.canaries.stats("p0").pending) == 1  # one per canary_interval
    for _ in range(10):
        s.clock.t += 1.0
        s.serve(SYSTEM + "burst")
    st = s.canaries.stats("p0")
    # Nothing was checked yet: past MAX_PENDING waiting, none is taken.
    assert len(st.pending) == MAX_PENDING and st.requests_with_blocks == 15
    assert len(st.pending[0].hashes) == CANARY_BLOCKS
    s.clock.t += 10
    assert s.canaries.check() == 0  # none found: each gets its second look
    s.clock.t += 2.0
    assert s.canaries.check() == MAX_PENDING and not st.pending


def test_no_canary_when_it_could_say_nothing() -> None:
    s = Setup()
    s.serve("short")  # no full block: not even counted
    assert s.canaries.stats("p0").requests_with_blocks == 0
    static = Worker("static-x", "prefill", "http://127.0.0.1:9000", CircuitBreaker())
    s.serve(SYSTEM, static)  # in no index under that id: counted, no canary
    assert s.canaries.stats("static-x").requests_with_blocks == 1
    assert not s.canaries.stats("static-x").pending
    decode = Worker("d0", "decode", "http://127.0.0.1:9001", CircuitBreaker(), source=ETCD)
    s.serve(SYSTEM, decode)
    assert s.canaries.stats("d0").requests_with_blocks == 0
    s.ignored.add("p0")
    s.serve(SYSTEM)
    assert s.canaries.stats("p0").requests_with_blocks == 1
    assert not s.canaries.stats("p0").pending
    s.ignored.clear()
    s.live = False
    s.clock.t += 5
    s.serve(SYSTEM)
    assert not s.canaries.stats("p0").pending


def test_due_while_not_live_or_ignored_is_dropped_unjudged_and_leave_forgets() -> None:
    s = Setup(canary_interval=0.0)
    s.serve(SYSTEM + "a")
    s.serve(SYSTEM + "b")
    s.clock.t += 3
    s.live = False
    assert s.canaries.check() == 0 and not s.canaries.stats("p0").pending
    s.live = True
    s.serve(SYSTEM + "b")
    s.ignored.add("p0")  # ignored by the time it is due: its entries say nothing
    s.clock.t += 3
    assert s.canaries.check() == 0 and s.canaries.stats("p0").misses == 0
    s.ignored.clear()
    s.serve(SYSTEM + "c")
    s.clock.t += 3
    assert s.canaries.check() == 0  # the first look; the miss counts at the second
    s.clock.t += 2
    assert s.canaries.check() == 1
    assert s.metric("miss")
    s.canaries.on_worker("leave", s.worker)
    assert s.canaries.stats("p0").misses == 0 and s.metric("miss") == []


async def test_the_router_checks_its_canaries(start_router: Any, etcd: Any, layout: Any,
                                              etcd_settings: Any, key_prefix: str, stubs: Any,
                                              register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    await register("p0", {"role": "prefill", "url": p.url, "model": "tiny", "block_size": 16})
    await register("d0", {"role": "decode", "url": d.url, "model": "tiny"})
    stored, lost = SYSTEM + "stored prompt", SYSTEM.upper() + "never stored"
    index = EtcdBlockIndex(etcd, layout, "tiny")
    await index.start()
    try:
        await index.add("p0", None, block_hashes(encode_text(stored), 16))
        await index.settle()
        client = await start_router(RouterConfig(
            etcd=etcd_settings, etcd_prefix=key_prefix, health_interval=60,
            tokenizers={None: "byte"}, canary_delay=0.3, canary_interval=0.0))

        async def health() -> dict[str, Any]:
            doc = await (await client.get("/debug/index_health")).json()
            return doc["instances"].get("p0", {})

        async def indexed() -> bool:
            return (await health()).get("index_blocks", 0) > 0

        await wait_for(indexed)
        assert (await client.post("/generate", json={"text": stored})).status == 200

        async def hit() -> bool:
            return (await health())["canary"]["hits"] == 1

        await wait_for(hit)
        assert (await client.post("/generate", json={"text": lost})).status == 200

        async def missed() -> bool:
            return (await health())["canary"]["misses"] == 1

        await wait_for(missed)
        doc = await health()
        assert doc["requests"] == 2 and doc["requests_with_blocks"] == 2
        assert doc["canary"]["consecutive_misses"] == 1
        assert isinstance(doc["canary"]["last_checked"], float)
        assert doc["source"] == "etcd" and doc["role"] == "prefill" and doc["url"] == p.url
        assert await client.metric_lines(
            'kvatlas_router_canary_total{instance="p0",result="hit"} 1.0')
        assert await client.metric_lines(
            'kvatlas_router_canary_total{instance="p0",result="miss"} 1.0')
    finally:
        await index.close()


async def test_a_canary_the_index_shows_at_its_second_look_is_a_hit() -> None:
    """An index that lags a busy moment is not a mismatch: the second look finds it."""
    s = Setup()
    hashes = s.serve(SYSTEM + "late")
    s.clock.t += 2.1
    assert s.canaries.check() == 0
    await s.index.add("p0", None, hashes)  # the events arrive late
    s.clock.t += 2.0
    assert s.canaries.check() == 1
    st = s.canaries.stats("p0")
    assert (st.hits, st.misses) == (1, 0)
