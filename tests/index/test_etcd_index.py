"""The etcd-backed block index against a real etcd: the BlockIndex contract, the writer's
coalescing, transaction sizes, resync and back-pressure, and the mirror's resume, compaction reload
and lease-expiry behaviour."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest
from agent_helpers import wait_until
from block_index_contract import BlockIndexContract
from etcd_block_index import EtcdBlockIndex

from index.etcd import Delete, EtcdClient, EtcdSettings, Put
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode, held_blocks
from index.writer import BlockWriter, BlockWriterConfig
from kvatlas.etcd_proc import free_port

FAST_MIRROR = BlockMirrorConfig(progress_every=0.05)
MODEL = "org/model-a"


class TestEtcdBlockIndex(BlockIndexContract):
    @pytest.fixture
    async def make_index(self, etcd: EtcdClient, layout: KeyLayout) -> AsyncIterator[object]:
        made: list[EtcdBlockIndex] = []

        async def make() -> EtcdBlockIndex:
            idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR,
                                 writer_config=BlockWriterConfig(flush_interval=0.002))
            await idx.start()
            made.append(idx)
            return idx

        yield make
        for idx in made:
            await idx.close()

    async def settle(self, index: EtcdBlockIndex) -> None:  # type: ignore[override]
        await index.settle(timeout=10)


# --- helpers --------------------------------------------------------------------------------


class CountingClient(EtcdClient):
    """A real client that also records every transaction's size and the peak concurrency."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.txn_sizes: list[int] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    async def txn(self, ops: Sequence[Put | Delete]) -> int:
        self.txn_sizes.append(len(ops))
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await super().txn(ops)
        finally:
            self.in_flight -= 1


class TcpProxy:
    """A loopback TCP proxy whose connections can be cut, to break one client's etcd link, or
    held, to delay what etcd sends that client (``hold``/``release``)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.open = True
        self._conns: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._conns |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       down: bool) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if down:
                        await self._flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))
        self._conns -= {writer, up_writer}

    def cut(self) -> None:
        self.open = False
        for w in list(self._conns):
            w.transport.abort()

    def restore(self) -> None:
        self.open = True

    def hold(self) -> None:
        """Keep what etcd sends from reaching the client until ``release()``."""
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def etcd_keys(etcd: EtcdClient, prefix: bytes) -> dict[bytes, int]:
    """key -> lease of every key under ``prefix``."""
    _, kvs = await etcd.get_prefix(prefix)
    return {kv.key: kv.lease for kv in kvs}


async def stored(etcd: EtcdClient, layout: KeyLayout, instance: str) -> dict[int, str]:
    """hash -> medium of every block etcd holds for ``instance`` (its segments decoded)."""
    _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL, instance))
    return held_blocks(kv.value for kv in kvs)


def hashes(n: int, start: int = 1) -> list[int]:
    return [0x1000_0000_0000_0000 + i for i in range(start, start + n)]


@contextlib.asynccontextmanager
async def session_for(client: EtcdClient, ttl: int = 10) -> AsyncIterator[LeaseSession]:
    session = LeaseSession(client, ttl)
    task = asyncio.create_task(session.run())
    try:
        await asyncio.wait_for(session.wait_lease(), 10)
        yield session
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- writer ---------------------------------------------------------------------------------


async def test_add_and_remove_in_one_window_writes_nothing(etcd: EtcdClient,
                                                           layout: KeyLayout) -> None:
    async with session_for(etcd) as session:
        w = BlockWriter(session, layout, MODEL, "p0", BlockWriterConfig(flush_interval=0.3))
        w.add(None, hashes(10))
        w.start()
        assert await w.wait_synced(10)
        txns, rev = w.txns, (await etcd.status()).revision
        fresh = hashes(50, start=100)
        w.add(None, fresh)          # new blocks ...
        w.remove(fresh)             # ... gone again in the same window
        w.remove(hashes(3))         # existing blocks removed ...
        w.add(None, hashes(3))      # ... and back, with the same parent and medium
        assert w.pending == 0
        assert await w.wait_synced(10)
        assert w.txns == txns
        assert (await etcd.status()).revision == rev
        assert set(await stored(etcd, layout, "p0")) == set(hashes(10))
        await w.close()


async def test_transactions_are_bounded_and_concurrent(etcd_settings: EtcdSettings,
                                                       layout: KeyLayout) -> None:
    client = CountingClient(etcd_settings)
    await client.connect()
    try:
        async with session_for(client) as session:
            cfg = BlockWriterConfig(flush_interval=0.05, max_inflight=4)
            w = BlockWriter(session, layout, MODEL, "p1", cfg)
            w.start()
            assert await w.wait_synced(10)
            client.txn_sizes.clear()
            for i in range(600):  # 600 chains of 10 blocks: 600 segments
                w.add(None, hashes(10, start=1 + i * 10))
            assert await w.wait_synced(20)
            assert max(client.txn_sizes) <= 128
            assert sum(client.txn_sizes) == 600
            assert client.peak_in_flight > 1
            assert client.peak_in_flight <= 4
            _, kvs = await client.get_prefix(layout.blocks_prefix(MODEL, "p1"))
            assert len(kvs) == 600 and len(held_blocks(kv.value for kv in kvs)) == 6000
            assert all(kv.lease == session.lease_id for kv in kvs)
            await w.close()
            await session.revoke()
    finally:
        await client.delete(layout.prefix.encode() + b"/", prefix=True)
        await client.close()


async def test_full_resync_deletes_stale_keys_and_keeps_identical_ones(
        etcd: EtcdClient, layout: KeyLayout) -> None:
    prefix = layout.blocks_prefix(MODEL, "p2")
    # Left over from a previous run of the same instance id: stale segments and a foreign key.
    await etcd.txn([Put(layout.segment(MODEL, "p2", 100 + i), encode(1.0, None, [h], ["GPU"]))
                    for i, h in enumerate(hashes(5, 900))]
                   + [Put(prefix + b"not-a-hash", b"x")])
    other = layout.segment(MODEL, "other", 1)
    await etcd.put(other, b"{}")
    async with session_for(etcd) as session:
        w = BlockWriter(session, layout, MODEL, "p2", BlockWriterConfig())
        w.add(None, hashes(20))
        w.start()
        assert await w.wait_synced(10)
        keys = await etcd_keys(etcd, prefix)
        assert set(keys) == {layout.segment(MODEL, "p2", 0)}  # one chain: one segment
        assert set(await stored(etcd, layout, "p2")) == set(hashes(20))
        assert set(keys.values()) == {session.lease_id}
        assert await etcd.get(other) is not None  # another instance's key is not ours to delete
        # A second resync under the same lease rewrites nothing that is already identical.
        written = w.segments_written
        w._need_resync("test")
        assert await w.wait_synced(10)
        assert w.resyncs == 2
        assert w.segments_written == written
        await w.close()


async def test_new_lease_rewrites_the_set(etcd: EtcdClient, layout: KeyLayout) -> None:
    prefix = layout.blocks_prefix(MODEL, "p3")
    async with session_for(etcd, ttl=3) as session:
        w = BlockWriter(session, layout, MODEL, "p3", BlockWriterConfig())
        w.add(None, hashes(30))
        w.start()
        assert await w.wait_synced(10)
        old = session.lease_id
        assert old is not None
        await etcd.revoke(old)  # etcd lost our lease (as after a long outage): keys are gone
        assert await etcd_keys(etcd, prefix) == {}
        w.add(hashes(30)[-1], hashes(1, start=31))  # the next write finds the lease gone
        await wait_until(lambda: session.lease_id not in (None, old) and w.state == "synced",
                         what="a new lease and a resync")
        assert await w.wait_synced(10)
        keys = await etcd_keys(etcd, prefix)
        assert len(await stored(etcd, layout, "p3")) == 31
        assert set(keys.values()) == {session.lease_id}
        assert w.failures >= 1 and w.resyncs >= 2
        await w.close()


async def test_outage_then_full_resync(etcd: EtcdClient, etcd_endpoint: str,
                                       layout: KeyLayout) -> None:
    """etcd unreachable for the writer: it keeps its set, degrades, and resyncs when back."""
    proxy = TcpProxy(etcd_endpoint.split(",")[0])
    await proxy.start()
    far = EtcdClient(EtcdSettings.from_text(proxy.endpoint, timeout=1.0))
    try:
        async with session_for(far) as session:
            w = BlockWriter(session, layout, MODEL, "p5", BlockWriterConfig())
            w.add(None, hashes(40))
            w.start()
            assert await w.wait_synced(10)
            proxy.cut()
            w.remove(hashes(10))
            w.add(hashes(40)[-1], hashes(5, start=41))
            await wait_until(lambda: w.state == "degraded", what="the writer to degrade")
            assert not await w.wait_synced(0.3)
            assert len(w) == 35  # the set itself never waits for etcd
            proxy.restore()
            assert await w.wait_synced(15)
            keys = await etcd_keys(etcd, layout.blocks_prefix(MODEL, "p5"))
            assert set(await stored(etcd, layout, "p5")) == set(hashes(35, start=11))
            assert set(keys.values()) == {session.lease_id}
            assert w.failures >= 1 and w.resyncs >= 2 and w.state == "synced"
            await w.close()
    finally:
        await far.close()
        await proxy.close()


async def test_pending_is_bounded_and_overflow_resyncs(etcd: EtcdClient,
                                                       layout: KeyLayout) -> None:
    async with session_for(etcd) as session:
        cfg = BlockWriterConfig(flush_interval=5.0, flush_ops=50, max_pending=100)
        w = BlockWriter(session, layout, MODEL, "p4", cfg)
        w.start()
        assert await w.wait_synced(10)
        for h in hashes(80):  # 80 chains of one block: 80 segments
            w.add(None, [h])
        assert len(w._set.dirty) == 80 and w.state != "resync_needed"
        for h in hashes(500, start=81):
            w.add(None, [h])
        assert w.overflows == 1
        assert len(w._set.dirty) == 0  # tracking stopped: memory is the set only
        assert w.state == "resync_needed"
        w.remove(hashes(10))
        assert len(w._set.dirty) == 0
        assert await w.wait_synced(10)
        assert w.resyncs == 2
        assert len(await stored(etcd, layout, "p4")) == 570
        await w.close()


# --- mirror ---------------------------------------------------------------------------------


async def test_lease_expiry_removes_the_instance_from_mirrors(etcd: EtcdClient,
                                                             layout: KeyLayout) -> None:
    idx = EtcdBlockIndex(etcd, layout, MODEL, lease_ttl=2, mirror_config=FAST_MIRROR)
    other = BlockMirror(etcd, layout, None, FAST_MIRROR)  # a second router, all models
    other.start()
    await idx.start()
    try:
        await idx.add("dies", None, hashes(40))
        await idx.add("lives", None, hashes(10))
        await idx.settle()
        assert await other.wait_revision(idx.mirror.revision, 10)
        assert idx.lookup(hashes(40)) == {"dies": 40, "lives": 10}
        assert other.lookup(hashes(40), MODEL) == {"dies": 40, "lives": 10}
        await idx.drop("dies", revoke=False)  # keepalives stop: the lease (2 s) runs out
        await wait_until(lambda: "dies" not in idx.instances() and "dies" not in
                         other.instances(MODEL), timeout=8, what="lease expiry")
        assert idx.lookup(hashes(40)) == {"lives": 10}
        assert other.lookup(hashes(40), MODEL) == {"lives": 10}
    finally:
        await other.close()
        await idx.close()


class UnansweredClient(EtcdClient):
    """A real client whose transactions etcd applies but whose answers never come back, as when
    a writer is closed while its transaction is on the wire."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.applied: list[int] = []
        self.first = asyncio.Event()

    async def txn(self, ops: Sequence[Put | Delete]) -> int:
        self.applied.append(await super().txn(ops))
        self.first.set()
        await asyncio.Event().wait()  # the answer is lost; only a cancellation ends this
        raise AssertionError("unreachable")


async def test_settle_covers_a_dropped_writers_unanswered_transaction(
        etcd_settings: EtcdSettings, etcd_endpoint: str, layout: KeyLayout) -> None:
    """A writer dropped (lease revoked) while its write is applied but unanswered, before the
    mirror has seen that write: settle() must not return before the mirror has seen it and the
    revoke that deleted it (the hypothesis state machine once caught a mirror still holding such
    blocks after settle)."""
    proxy = TcpProxy(etcd_endpoint.split(",")[0])
    await proxy.start()
    far = EtcdClient(EtcdSettings.from_text(proxy.endpoint, timeout=5.0))
    lossy = UnansweredClient(etcd_settings)
    await far.connect()
    await lossy.connect()
    idx = EtcdBlockIndex(lossy, layout, MODEL)
    # The index's reads come from a mirror whose watch the proxy can hold back.
    idx.mirror = BlockMirror(far, layout, MODEL, FAST_MIRROR)
    await idx.start()
    try:
        proxy.hold()
        await idx.add("x", None, hashes(13))
        await asyncio.wait_for(lossy.first.wait(), 10)
        await idx.drop("x", revoke=True)
        proxy.release()
        await idx.settle(timeout=10)
        assert idx.mirror.revision > lossy.applied[0], (
            "settle() returned before the mirror reached the revoke of the dropped writer")
        assert idx.blocks("x") == set() and "x" not in idx.instances()
    finally:
        proxy.release()
        await idx.close()
        await lossy.close()
        await far.close()
        await proxy.close()


async def test_watch_resumes_after_disconnect(etcd: EtcdClient, etcd_endpoint: str,
                                              layout: KeyLayout) -> None:
    proxy = TcpProxy(etcd_endpoint.split(",")[0])
    await proxy.start()
    far = EtcdClient(EtcdSettings.from_text(proxy.endpoint, timeout=2.0))
    mirror = BlockMirror(far, layout, MODEL, FAST_MIRROR)
    idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR)
    await idx.start()
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        await idx.add("a", None, hashes(20))
        await idx.settle()
        assert await mirror.wait_revision(idx.mirror.revision, 10)
        proxy.cut()
        await wait_until(lambda: mirror.disconnects >= 1, what="the watch to break")
        await idx.remove("a", hashes(5, start=16))
        await idx.add("b", None, hashes(7))
        await idx.settle()
        assert mirror.lookup(hashes(20)) == {"a": 20}  # cut off: still the old view
        proxy.restore()
        assert await mirror.wait_revision(idx.mirror.revision, 15)
        assert mirror.lookup(hashes(20)) == {"a": 15, "b": 7}
        assert mirror.resumes >= 1
        assert mirror.reloads == 1 and mirror.compactions == 0
    finally:
        await mirror.close()
        await idx.close()
        await far.close()
        await proxy.close()


async def test_compacted_revision_triggers_full_reload(etcd: EtcdClient, etcd_endpoint: str,
                                                      layout: KeyLayout) -> None:
    proxy = TcpProxy(etcd_endpoint.split(",")[0])
    await proxy.start()
    far = EtcdClient(EtcdSettings.from_text(proxy.endpoint, timeout=2.0))
    mirror = BlockMirror(far, layout, MODEL, FAST_MIRROR)
    idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR)
    await idx.start()
    mirror.start()
    try:
        await idx.add("a", None, hashes(30))
        await idx.settle()
        assert await mirror.wait_revision(idx.mirror.revision, 10)
        proxy.cut()
        await wait_until(lambda: mirror.disconnects >= 1, what="the watch to break")
        await idx.clear("a")
        await idx.add("b", None, hashes(12))
        await idx.settle()
        await etcd.compact((await etcd.status()).revision)
        proxy.restore()
        await wait_until(lambda: mirror.reloads == 2, timeout=15, what="a reload")
        assert mirror.compactions == 1
        assert mirror.lookup(hashes(30)) == {"b": 12}
        assert mirror.instances() == {"b"}
    finally:
        await mirror.close()
        await idx.close()
        await far.close()
        await proxy.close()


async def test_two_mirrors_agree_with_the_writers(etcd: EtcdClient, etcd_settings: EtcdSettings,
                                                  layout: KeyLayout) -> None:
    import random

    rng = random.Random(7)
    second_client = EtcdClient(etcd_settings)
    second = BlockMirror(second_client, layout, MODEL, FAST_MIRROR)
    idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR)
    await idx.start()
    second.start()
    try:
        pool = hashes(400)
        for step in range(300):
            inst = f"i{rng.randrange(5)}"
            op = rng.random()
            if op < 0.6:
                start = rng.randrange(len(pool) - 20)
                chunk = pool[start:start + rng.randrange(1, 20)]
                await idx.add(inst, None, chunk, medium=rng.choice(["GPU", "CPU"]))
            elif op < 0.95:
                await idx.remove(inst, rng.sample(pool, 15))
            else:
                await idx.clear(inst)
            if step % 50 == 0:
                await asyncio.sleep(0.005)
        await idx.settle()
        assert await second.wait_revision(idx.mirror.revision, 10)
        expected = {i: set(w.blocks()) for i, w in idx.writers.items() if len(w)}
        for mirror in (idx.mirror, second):
            assert mirror.instances() == set(expected)
            for inst, blocks in expected.items():
                assert mirror.blocks(inst) == blocks
                table = mirror.table()
                assert all(table.medium(inst, h) == idx.writers[inst].blocks()[h][0]
                           for h in blocks)
        assert second.lag_stats()["samples"] > 0
    finally:
        await second.close()
        await idx.close()
        await second_client.close()


async def test_all_models_mirror_keeps_models_apart(etcd: EtcdClient, layout: KeyLayout) -> None:
    first = EtcdBlockIndex(etcd, layout, "org/a", mirror_config=FAST_MIRROR)
    second = EtcdBlockIndex(etcd, layout, "b c%", mirror_config=FAST_MIRROR)
    every = BlockMirror(etcd, layout, None, FAST_MIRROR)
    await first.start()
    await second.start()
    every.start()
    try:
        await first.add("x", None, hashes(6))
        await second.add("x", None, hashes(3))
        await second.add("y", None, hashes(6), medium="DISK")
        await first.settle()
        await second.settle()
        assert await every.wait_revision(max(first.mirror.revision, second.mirror.revision), 10)
        assert first.lookup(hashes(6)) == {"x": 6}
        assert second.lookup(hashes(6)) == {"x": 3, "y": 6}
        assert every.lookup(hashes(6), "org/a") == {"x": 6}
        assert every.lookup(hashes(6), "b c%") == {"x": 3, "y": 6}
        assert every.table("b c%").medium("y", hashes(1)[0]) == "DISK"
        assert set(every.tables) == {"org/a", "b c%"}
        with pytest.raises(ValueError):
            every.lookup(hashes(1))  # an all-models mirror needs the model
    finally:
        await every.close()
        await first.close()
        await second.close()
