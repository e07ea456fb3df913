"""Hypothesis state machine: random add / remove / clear / instance death (lease revoked or left
to expire) against a real etcd, read back through two independent mirrors. After quiescence every
mirror must equal the model that the writers were given."""
from __future__ import annotations

import asyncio
import uuid

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

from index.etcd import EtcdClient, EtcdSettings
from index.etcd_index import EtcdBlockIndex
from index.keys import KeyLayout
from index.mirror import BlockMirror, BlockMirrorConfig
from index.writer import BlockWriterConfig

MODEL = "m"
INSTANCES = ("a", "b", "c")
POOL = [0x9E37_79B9_7F4A_7C15 * (i + 1) % 2**64 for i in range(24)]
MIRROR = BlockMirrorConfig(progress_every=0.05)
# A long enough window that consecutive steps coalesce; small batches so several txns fly at once.
WRITER = BlockWriterConfig(flush_interval=0.005, txn_ops=8, max_inflight=3)

instances = st.sampled_from(INSTANCES)
runs = st.tuples(st.integers(0, len(POOL) - 1), st.integers(1, 8))
subsets = st.lists(st.sampled_from(POOL), max_size=8)


def make_machine(endpoint: str) -> type[RuleBasedStateMachine]:
    class EtcdIndexMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.layout = KeyLayout(f"/kvatlas-sm-{uuid.uuid4().hex[:12]}")
            self.clients = [EtcdClient(EtcdSettings.from_text(endpoint, timeout=3.0))
                            for _ in range(2)]
            self.index = EtcdBlockIndex(self.clients[0], self.layout, MODEL, lease_ttl=5,
                                        writer_config=WRITER, mirror_config=MIRROR)
            self.other = BlockMirror(self.clients[1], self.layout, None, MIRROR)
            self.model: dict[str, set[int]] = {i: set() for i in INSTANCES}
            self.run(self._start())

        def run(self, coro):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

        async def _start(self) -> None:
            for c in self.clients:
                await c.connect()
            await self.index.start()
            self.other.start()
            assert await self.other.wait_ready(10)

        @rule(inst=instances, run=runs)
        def add(self, inst: str, run: tuple[int, int]) -> None:
            start, n = run
            chunk = POOL[start:start + n]
            parent = POOL[start - 1] if start else None
            self.run(self.index.add(inst, parent, chunk))
            self.model[inst] |= set(chunk)

        @rule(inst=instances, n=st.integers(8, len(POOL)))
        def add_long(self, inst: str, n: int) -> None:
            self.run(self.index.add(inst, None, POOL[:n], medium="CPU" if n % 2 else "GPU"))
            self.model[inst] |= set(POOL[:n])

        @rule(inst=instances, hashes=subsets)
        def remove(self, inst: str, hashes: list[int]) -> None:
            self.run(self.index.remove(inst, hashes))
            self.model[inst] -= set(hashes)

        @rule(inst=instances)
        def clear(self, inst: str) -> None:
            self.run(self.index.clear(inst))
            self.model[inst] = set()

        @rule(inst=instances)
        def die(self, inst: str) -> None:
            """The instance's process dies: its lease is revoked and etcd drops its keys."""
            self.run(self.index.drop(inst, revoke=True))
            self.model[inst] = set()

        @rule()
        def quiesce(self) -> None:
            self.run(self._check())

        async def _check(self) -> None:
            await self.index.settle(timeout=15)
            assert await self.other.wait_revision(self.index.mirror.revision, 10)
            live = {i for i, hs in self.model.items() if hs}
            for inst, hs in self.model.items():
                writer = self.index.writers.get(inst)
                assert (set(writer.blocks()) if writer else set()) == hs
                assert self.index.blocks(inst) == hs, f"mirror 1 differs for {inst}"
                assert self.other.blocks(inst, MODEL) == hs, f"mirror 2 differs for {inst}"
            assert self.index.instances() == live
            assert self.other.instances(MODEL) == live

        def teardown(self) -> None:
            try:
                self.run(self._check())
            finally:
                self.run(self._stop())
                self.loop.close()

        async def _stop(self) -> None:
            await self.other.close()
            await self.index.close(revoke=True)
            await self.clients[0].delete(self.layout.prefix.encode() + b"/", prefix=True)
            for c in self.clients:
                await c.close()

    return EtcdIndexMachine


def test_mirrors_converge_to_the_writers_model(etcd_endpoint: str) -> None:
    machine = make_machine(etcd_endpoint)
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow]))
