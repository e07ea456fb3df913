"""Hypothesis state machine: random add / remove / clear / instance death (lease revoked or left
to expire) against a real etcd, read back through two independent mirrors. After quiescence every
mirror must equal the model that the writers were given, media included.

A lease left to expire costs its TTL in wall time at the next quiescence, so only instance "c"
has a short (2 s) lease, and expiry runs as a second, short machine (few examples, at most one
expiry each): the runtime stays bounded whatever hypothesis draws."""
from __future__ import annotations

import asyncio
import uuid

from etcd_block_index import EtcdBlockIndex
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.mirror import BlockMirror, BlockMirrorConfig
from index.writer import BlockWriterConfig

MODEL = "m"
INSTANCES = ("a", "b", "c")
TTL = {"a": 5, "b": 5, "c": 2}  # seconds; "c" is the one whose lease may be left to expire
MORTAL = "c"
MEDIA = ("GPU", "CPU", "CPU_PINNED")
POOL = [0x9E37_79B9_7F4A_7C15 * (i + 1) % 2**64 for i in range(24)]
MIRROR = BlockMirrorConfig(progress_every=0.05)
# A long enough window that consecutive steps coalesce; small batches so several txns fly at once.
WRITER = BlockWriterConfig(flush_interval=0.005, txn_ops=8, max_inflight=3)

instances = st.sampled_from(INSTANCES)
runs = st.tuples(st.integers(0, len(POOL) - 1), st.integers(1, 8))
subsets = st.lists(st.sampled_from(POOL), max_size=8)
media = st.sampled_from(MEDIA)


def make_machine(endpoint: str, expiry: bool = False) -> type[RuleBasedStateMachine]:
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
            # instance -> {hash: medium}
            self.model: dict[str, dict[int, str]] = {i: {} for i in INSTANCES}
            self.expired = 0
            self.run(self._start())

        def run(self, coro):  # type: ignore[no-untyped-def]
            return self.loop.run_until_complete(asyncio.wait_for(coro, 30))

        async def _start(self) -> None:
            for c in self.clients:
                await c.connect()
            await self.index.start()
            self.other.start()
            assert await self.other.wait_ready(10)

        async def _add(self, inst: str, parent: int | None, chunk: list[int],
                       medium: str) -> None:
            self.index.writer(inst, lease_ttl=TTL[inst])
            await self.index.add(inst, parent, chunk, medium)

        @initialize(n=st.integers(1, len(POOL)), medium=media)
        def seed_mortal(self, n: int, medium: str) -> None:
            """The mortal instance starts with blocks, so that an expiry has something to drop."""
            self.run(self._add(MORTAL, None, POOL[:n], medium))
            self.model[MORTAL].update(dict.fromkeys(POOL[:n], medium))

        @rule(inst=instances, run=runs, medium=media)
        def add(self, inst: str, run: tuple[int, int], medium: str) -> None:
            start, n = run
            chunk = POOL[start:start + n]
            parent = POOL[start - 1] if start else None
            self.run(self._add(inst, parent, chunk, medium))
            self.model[inst].update(dict.fromkeys(chunk, medium))

        @rule(inst=instances, n=st.integers(8, len(POOL)))
        def add_long(self, inst: str, n: int) -> None:
            medium = "CPU" if n % 2 else "GPU"
            self.run(self._add(inst, None, POOL[:n], medium))
            self.model[inst].update(dict.fromkeys(POOL[:n], medium))

        @rule(inst=instances, hashes=subsets)
        def remove(self, inst: str, hashes: list[int]) -> None:
            self.run(self.index.remove(inst, hashes))
            for h in hashes:
                self.model[inst].pop(h, None)

        @rule(inst=instances)
        def clear(self, inst: str) -> None:
            self.run(self.index.clear(inst))
            self.model[inst] = {}

        @rule(inst=instances)
        def die(self, inst: str) -> None:
            """The instance's process dies cleanly: its lease is revoked, etcd drops its keys."""
            self.run(self.index.drop(inst, revoke=True))
            self.model[inst] = {}

        @precondition(lambda self: expiry and not self.expired
                      and len(self.index.writers.get(MORTAL) or ()) > 0)
        @rule()
        def expire(self) -> None:
            """The instance's process vanishes: keepalives stop and the lease runs out (2 s)."""
            self.run(self.index.settle(timeout=15))  # its blocks are in etcd when it goes
            self.run(self.index.drop(MORTAL, revoke=False))
            self.model[MORTAL] = {}
            self.expired += 1

        @rule()
        def quiesce(self) -> None:
            self.run(self._check())

        async def _check(self) -> None:
            await self.index.settle(timeout=15)
            assert await self.other.wait_revision(self.index.mirror.revision, 10)
            live = {i for i, hs in self.model.items() if hs}
            table = self.other.table(MODEL)
            for inst, want in self.model.items():
                hs = set(want)
                writer = self.index.writers.get(inst)
                assert (set(writer.blocks()) if writer else set()) == hs
                assert self.index.blocks(inst) == hs, f"mirror 1 differs for {inst}"
                assert self.other.blocks(inst, MODEL) == hs, f"mirror 2 differs for {inst}"
                got1 = {h: self.index.medium(inst, h) for h in hs}
                got2 = {h: table.medium(inst, h) for h in hs}
                assert got1 == want, f"mirror 1 media differ for {inst}"
                assert got2 == want, f"mirror 2 media differ for {inst}"
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


def test_mirrors_converge_when_a_lease_expires(etcd_endpoint: str) -> None:
    machine = make_machine(etcd_endpoint, expiry=True)
    # Each example may let "c"'s 2 s lease run out once: 5 examples bound the extra wall time.
    run_state_machine_as_test(machine, settings=settings(
        max_examples=5, stateful_step_count=20, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow]))
