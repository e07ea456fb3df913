"""The mirror against input and failures it must survive: foreign keys under the blocks prefix,
batches that fail to apply, RESOURCE_EXHAUSTED watches, huge (fragmented) lease expiries; and the
bounded caches of the mirror and of ``EtcdBlockIndex``; and the writer on a lease that dies during
its resync."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from etcd_block_index import EtcdBlockIndex
from waiting import wait_until

from index.errors import EtcdRequestError
from index.etcd import Delete, EtcdClient, EtcdSettings, Put, WatchBatch, WatchEvent
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.mirror import BlockMirror, BlockMirrorConfig
from index.segments import encode, held_blocks
from index.writer import BlockWriter, BlockWriterConfig

FAST = BlockMirrorConfig(progress_every=0.05)


def key(layout: KeyLayout, model: str, inst: str, h: int) -> bytes:
    """The key of a segment of one block whose id is its hash."""
    return layout.segment(model, inst, h)


def put(layout: KeyLayout, model: str, inst: str, h: int, lease: int = 0,
        medium: str = "GPU") -> Put:
    """A writer's put of that one-block segment."""
    return Put(key(layout, model, inst, h), encode(1.0, None, [h], [medium]), lease)


async def test_foreign_keys_are_counted_and_skipped(etcd: EtcdClient, layout: KeyLayout) -> None:
    value = b'{"m":"GPU","p":null,"t":1.0}'
    root = layout.blocks_prefix()
    one = BlockMirror(etcd, layout, "m", FAST)
    every = BlockMirror(etcd, layout, None, FAST)
    for m in (one, every):
        m.start()
        assert await m.wait_ready(10)
    try:
        await etcd.txn([put(layout, "m", "a", 1)])
        foreign = [
            root + b"m/\xff\xfe/0000000000000002",        # instance id not UTF-8
            root + b"m/a/-000000000000003",               # int(..., 16) would take it as -3
            root + b"m/a/0x00000000000004",
            root + b"m/a/00000000000000A5",               # upper case is not canonical
            root + b"m/a/000000000000 06",
            root + b"m/a/extra/0000000000000007",         # extra path segment
            root + b"m/bad id/0000000000000008",          # invalid instance id
            root + b"%ff%fe/a/0000000000000009",          # model not UTF-8 once unquoted
            root + b"%6d/a/000000000000000a",             # "m", but not as KeyLayout quotes it
        ]
        for k in foreign:
            await etcd.put(k, value)
        rev = await etcd.txn([put(layout, "m", "a", 10)])
        assert await one.wait_revision(rev, 10) and await every.wait_revision(rev, 10)
        assert one.blocks("a") == {1, 10} and one.instances() == {"a"}
        assert every.blocks("a", "m") == {1, 10} and every.instances("m") == {"a"}
        assert one.bad_keys == len(foreign) - 2  # two foreign models are outside its prefix
        assert every.bad_keys == len(foreign)
        # Deletes of foreign keys are skipped the same way.
        await etcd.delete(root + b"m/\xff\xfe/0000000000000002")
        rev = await etcd.txn([put(layout, "m", "b", 11)])
        assert await one.wait_revision(rev, 10) and await every.wait_revision(rev, 10)
        assert one.lookup([11]) == {"b": 1} and every.lookup([11], "m") == {"b": 1}
        for m in (one, every):
            assert m._task is not None and not m._task.done()
            assert m.errors == 0
        # A mirror that starts with the foreign keys in place loads the valid ones.
        late = BlockMirror(etcd, layout, None, FAST)
        late.start()
        try:
            assert await late.wait_ready(10)
            assert late.blocks("a", "m") == {1, 10}
            assert late.bad_keys == len(foreign) - 1  # the delete above removed one
        finally:
            await late.close()
    finally:
        await one.close()
        await every.close()


class OnceWatchClient(EtcdClient):
    """A real client that alters the first watch batch carrying events, once (``hit``)."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.hit = False

    def alter(self, batch: WatchBatch) -> WatchBatch:
        raise NotImplementedError

    async def watch_prefix(self, prefix: bytes, start_revision: int,  # type: ignore[override]
                           progress_every: float | None = None,
                           fragment: bool = False) -> AsyncIterator[WatchBatch]:
        async for batch in super().watch_prefix(prefix, start_revision, progress_every, fragment):
            if batch.events and not self.hit:
                self.hit = True
                batch = self.alter(batch)
            yield batch


class GarbageOnceClient(OnceWatchClient):
    """The batch also carries one impossible event."""

    def alter(self, batch: WatchBatch) -> WatchBatch:
        bad = WatchEvent(True, batch.events[0].key, None, batch.revision)  # type: ignore[arg-type]
        return WatchBatch(batch.revision, [*batch.events, bad])


async def test_an_impossible_event_is_skipped_and_the_batch_still_applies(
        etcd_settings: EtcdSettings, etcd: EtcdClient, layout: KeyLayout) -> None:
    # A put without a value used to fail the whole batch (a reload); it is data like any other
    # bad value now: skipped and counted, the batch's other events applied, no reload. (A hook
    # that fails for real is still answered with a reload: tests/index/test_follow.py.)
    client = GarbageOnceClient(etcd_settings)
    await client.connect()
    mirror = BlockMirror(client, layout, "m", FAST)
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        rev = await etcd.txn([put(layout, "m", "a", 1)])
        assert await mirror.wait_revision(rev, 10)
        assert client.hit and mirror.skipped == {"truncated": 1}
        rev = await etcd.txn([put(layout, "m", "a", 2)])
        assert await mirror.wait_revision(rev, 10)
        # The impossible put came after the real one in its batch: it emptied key 1 as a put of
        # any bad value does.
        assert mirror.blocks("a") == {2}
        assert mirror.reloads == 1 and mirror.errors == 0 and mirror.ready
        assert mirror._task is not None and not mirror._task.done()
    finally:
        await mirror.close()
        await client.close()


class ExhaustedOnceClient(OnceWatchClient):
    """The watch breaks there, the way an oversized response does."""

    def alter(self, batch: WatchBatch) -> WatchBatch:
        raise EtcdRequestError("etcd refused the request (RESOURCE_EXHAUSTED): "
                               "Received message larger than max", op="watch")


async def test_resource_exhausted_watch_reloads(etcd_settings: EtcdSettings, etcd: EtcdClient,
                                                layout: KeyLayout) -> None:
    client = ExhaustedOnceClient(etcd_settings)
    await client.connect()
    mirror = BlockMirror(client, layout, "m", FAST)
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        rev = await etcd.txn([put(layout, "m", "a", 1)])
        assert await mirror.wait_revision(rev, 10)
        assert mirror.blocks("a") == {1}
        assert client.hit and mirror.reloads == 2 and mirror.resumes == 0
    finally:
        await mirror.close()
        await client.close()


async def test_huge_lease_expiry_arrives_as_one_reassembled_batch(etcd: EtcdClient,
                                                                  layout: KeyLayout) -> None:
    # etcd fragments a watch response past --max-request-bytes plus 512 KiB of gRPC overhead (2 MiB
    # by default): 16k deletes of ~190-byte keys (a long instance id) come in two parts (checked
    # against etcd 3.5 by reading the raw stream); the client must hand them over as one batch.
    n = 16_000
    inst = "i" * 120
    lease, _ = await etcd.grant(30)
    blocks = list(range(1, n + 1))
    sem = asyncio.Semaphore(8)

    async def put_all(chunk: list[int]) -> None:
        async with sem:
            await etcd.txn([put(layout, "m", inst, h, lease) for h in chunk])

    await asyncio.gather(*(put_all(blocks[i:i + 128]) for i in range(0, n, 128)))
    mirror = BlockMirror(etcd, layout, "m", FAST)
    mirror.start()
    rev0, _ = await etcd.get_prefix(layout.blocks_prefix("m"), keys_only=True)
    batches: list[WatchBatch] = []
    created = asyncio.Event()

    async def watch() -> None:
        async for batch in etcd.watch_prefix(layout.blocks_prefix("m"), rev0 + 1, fragment=True):
            if batch.created:
                created.set()
            if batch.events:
                batches.append(batch)
                if sum(len(b.events) for b in batches) >= n:
                    return

    try:
        assert await mirror.wait_ready(10) and len(mirror.blocks(inst)) == n
        watcher = asyncio.create_task(watch())
        await wait_until(created.is_set, what="etcd answered that the watch is created")
        await etcd.revoke(lease)
        await asyncio.wait_for(watcher, 20)
        assert len(batches) == 1 and len(batches[0].events) == n
        assert not any(ev.put for ev in batches[0].events)
        await wait_until(lambda: not mirror.blocks(inst), what="the mirror to apply the revoke")
        assert mirror.instances() == set() and mirror.errors == 0
    finally:
        await mirror.close()


async def test_caches_shrink_when_instances_and_models_go(etcd: EtcdClient,
                                                          layout: KeyLayout) -> None:
    every = BlockMirror(etcd, layout, None, FAST)
    every.start()
    assert await every.wait_ready(10)
    try:
        lease, _ = await etcd.grant(30)
        rev = await etcd.txn([put(layout, f"model-{i}", f"inst-{i}", 1, lease, "CPU")
                              for i in range(20)] + [put(layout, "kept", "k", 1, medium="CPU")])
        assert await every.wait_revision(rev, 10)
        assert len(every.tables) == 21 and every.stats()["cached_names"] == 42
        await etcd.revoke(lease)
        await wait_until(lambda: len(every.tables) == 1, what="empty model tables to go")
        assert set(every.tables) == {"kept"} and every.instances("kept") == {"k"}
        assert every.stats()["cached_names"] == 2
        # Deletes of an instance never seen must not leave a name behind either.
        await etcd.txn([Delete(key(layout, "kept", "ghost", 5))])
        rev = await etcd.txn([put(layout, "kept", "k", 2)])
        assert await every.wait_revision(rev, 10)
        assert every.blocks("k", "kept") == {1, 2}
        assert every.stats()["cached_names"] == 2
    finally:
        await every.close()


async def test_dropped_instances_are_not_remembered_forever(etcd: EtcdClient,
                                                            layout: KeyLayout) -> None:
    idx = EtcdBlockIndex(etcd, layout, "m", mirror_config=FAST,
                         writer_config=BlockWriterConfig(flush_interval=0.002))
    await idx.start()
    try:
        for i in range(5):
            await idx.add(f"i{i}", None, [100 + i])
        await idx.settle()
        for i in range(5):
            await idx.drop(f"i{i}", revoke=True)
            await wait_until(lambda i=i: f"i{i}" not in idx.instances(), what="revoked keys to go")
        # Without any settle() in between, only the newest drop can still be waited for.
        assert set(idx._gone) <= {"i4"}
    finally:
        await idx.close()


class RevokeOnFirstPutClient(EtcdClient):
    """A real client that revokes the lease of the first leased put before sending it, as if the
    lease had expired while the writer was between grant and resync."""

    def __init__(self, settings: EtcdSettings) -> None:
        super().__init__(settings)
        self.revoked: int | None = None

    async def txn(self, ops: Sequence[Put | Delete]) -> int:
        lease = next((op.lease for op in ops if isinstance(op, Put) and op.lease), 0)
        if lease and self.revoked is None:
            self.revoked = lease
            await self.revoke(lease)
        return await super().txn(ops)


async def test_writer_reports_the_lease_its_failing_resync_used(etcd_settings: EtcdSettings,
                                                                layout: KeyLayout) -> None:
    client = RevokeOnFirstPutClient(etcd_settings)
    await client.connect()
    session = LeaseSession(client, ttl=30)  # keepalives alone would notice only after 10 s
    task = asyncio.create_task(session.run())
    writer = BlockWriter(session, layout, "m", "w", BlockWriterConfig(flush_interval=0.002))
    writer.add(None, [1, 2, 3])
    writer.start()
    try:
        assert await writer.wait_synced(5), writer.stats()
        assert client.revoked is not None and session.lease_id != client.revoked
        assert session.generation == 2
        # No hot loop on the dead lease: one failure, then a resync under the new lease.
        assert writer.failures == 1 and writer.resyncs == 1
        _, kvs = await client.get_prefix(writer.prefix)
        assert len(held_blocks(kv.value for kv in kvs)) == 3
        assert {kv.lease for kv in kvs} == {session.lease_id}
    finally:
        await writer.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await session.revoke()
        await client.close()


async def test_blocks_of_the_layout_before_segments_are_named_not_read(
        etcd: EtcdClient, layout: KeyLayout, caplog) -> None:  # type: ignore[no-untyped-def]
    # What a writer of kvatlas before segments puts: one JSON key per block under /v1/blocks/.
    await etcd.put(layout.legacy_blocks_prefix() + b"m/old/00000000000000aa",
                   b'{"m":"GPU","p":null,"t":1.0}')
    await etcd.txn([put(layout, "m", "new", 0xbb)])
    mirror = BlockMirror(etcd, layout, "m", FAST)
    mirror.start()
    try:
        assert await mirror.wait_ready(10)
        assert mirror.instances() == {"new"}  # the old writer's blocks are not read ...
        assert mirror.stats()["legacy_blocks"] == 1  # ... but named
        assert any("before block segments" in r.getMessage() and "upgrade" in r.getMessage()
                   for r in caplog.records), caplog.text
    finally:
        await mirror.close()
