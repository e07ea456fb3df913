"""``IndexReader`` (index/reader.py): the contract on the memory index and on the etcd mirror
(real etcd), and what only a mirror of every model does (per-model answers and versions)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest
from etcd_block_index import EtcdBlockIndex
from memory_index import MemoryBlockIndex
from reader_contract import MODEL, ReaderContract, chain_of

from index.etcd import Delete, EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.mirror import BlockMirror, BlockMirrorConfig
from index.reader import IndexReader
from index.sharded import ShardedIndex
from index.writer import BlockWriterConfig
from kvatlas.etcd_proc import EtcdCluster

FAST_MIRROR = BlockMirrorConfig(progress_every=0.05)
FAST_WRITER = BlockWriterConfig(flush_interval=0.002)
OTHER = "org/other model"


class TestMemoryReader(ReaderContract):
    @pytest.fixture
    def make_reader(self) -> object:
        async def make() -> tuple[MemoryBlockIndex, MemoryBlockIndex]:
            idx = MemoryBlockIndex(MODEL)
            return idx, idx
        return make


class TestMirrorReader(ReaderContract):
    @pytest.fixture
    async def make_reader(self, etcd: EtcdClient, layout: KeyLayout) -> AsyncIterator[object]:
        made: list[EtcdBlockIndex] = []

        async def make() -> tuple[BlockMirror, EtcdBlockIndex]:
            idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR,
                                 writer_config=FAST_WRITER)
            await idx.start()
            made.append(idx)
            return idx.mirror, idx

        yield make
        for idx in made:
            await idx.close()

    async def settle(self, writer: EtcdBlockIndex) -> None:  # type: ignore[override]
        await writer.settle(timeout=10)


class TestShardedReader(ReaderContract):
    """Two shards: the writes land on the session's etcd, the second etcd holds nothing; the
    answers must be the one shard's, unchanged by the other."""

    @pytest.fixture
    async def make_reader(self, etcd: EtcdClient, layout: KeyLayout,
                          etcd_shard: EtcdCluster) -> AsyncIterator[object]:
        made: list[EtcdBlockIndex] = []
        async with contextlib.AsyncExitStack() as stack:
            async def make() -> tuple[ShardedIndex, EtcdBlockIndex]:
                idx = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR,
                                     writer_config=FAST_WRITER)
                await idx.start()
                made.append(idx)
                other = EtcdClient(EtcdSettings.from_text(etcd_shard.endpoints))
                stack.push_async_callback(other.close)
                empty = BlockMirror(other, layout, MODEL, FAST_MIRROR)
                stack.push_async_callback(empty.close)
                empty.start()
                assert await empty.wait_ready(10)
                return ShardedIndex([idx.mirror, empty]), idx

            yield make
            for idx in made:
                await idx.close()

    async def settle(self, writer: EtcdBlockIndex) -> None:  # type: ignore[override]
        await writer.settle(timeout=10)


def test_every_kind_is_a_reader() -> None:
    assert all(issubclass(c, IndexReader) for c in (BlockMirror, MemoryBlockIndex, ShardedIndex))


async def test_a_mirror_not_loaded_is_not_ready(etcd: EtcdClient, layout: KeyLayout) -> None:
    mirror = BlockMirror(etcd, layout, MODEL, FAST_MIRROR)
    st = mirror.status()
    assert not mirror.ready and not mirror.connected and not st.ready and not st.connected
    assert mirror.models() == {MODEL} and mirror.match(MODEL, chain_of(2)) == {}


async def test_a_mirror_of_every_model_answers_per_model(etcd: EtcdClient,
                                                         layout: KeyLayout) -> None:
    first = EtcdBlockIndex(etcd, layout, MODEL, mirror_config=FAST_MIRROR,
                           writer_config=FAST_WRITER)
    second = EtcdBlockIndex(etcd, layout, OTHER, mirror_config=FAST_MIRROR,
                            writer_config=FAST_WRITER)
    every = BlockMirror(etcd, layout, None, FAST_MIRROR)
    await first.start()
    await second.start()
    every.start()
    try:
        assert await every.wait_ready(10)
        assert every.model is None and every.models() == frozenset()
        prompt = chain_of(4)
        await first.add("a", None, prompt)
        await second.add("a", None, prompt[:2])
        await second.add("b", None, prompt)
        await first.settle(timeout=10)
        await second.settle(timeout=10)
        assert await every.wait_revision(max(first.mirror.revision, second.mirror.revision), 10)

        assert every.models() == {MODEL, OTHER}
        assert every.match(MODEL, prompt) == {"a": 4}
        assert every.match(OTHER, prompt) == {"a": 2, "b": 4}
        a = every.instance("a")
        assert a is not None and dict(a.blocks) == {MODEL: 4, OTHER: 2}
        assert every.instance_ids() == {"a", "b"}
        assert every.block_count(MODEL) == 4 and every.block_count(OTHER) == 4
        assert every.block_count() == every.status().blocks == 8

        # A change in one model moves that model's version and the whole index's, not the other's.
        v_all, v_model, v_other = every.version(), every.version(MODEL), every.version(OTHER)
        await second.remove("b", prompt[1:])
        await second.settle(timeout=10)
        assert await every.wait_revision(second.mirror.revision, 10)
        assert every.version(MODEL) == v_model
        assert every.version(OTHER) != v_other and every.version() != v_all

        # A delete in a model the mirror never saw creates no model.
        rev = await etcd.txn([Delete(layout.segment("never/seen", "a", prompt[0]))])
        assert await every.wait_revision(rev, 10)
        assert every.models() == {MODEL, OTHER}

        # A model whose last block goes is no longer listed.
        await second.clear("a")
        await second.clear("b")
        await second.settle(timeout=10)
        assert await every.wait_revision(second.mirror.revision, 10)
        assert every.models() == {MODEL} and every.match(OTHER, prompt) == {}
        assert every.instance("b") is None
        a = every.instance("a")
        assert a is not None and dict(a.blocks) == {MODEL: 4}
    finally:
        await every.close()
        await second.close()
        await first.close()
