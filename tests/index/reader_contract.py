"""The contract every ``IndexReader`` must meet (not collected on its own).

Reuse it by subclassing in a ``test_*.py`` module and providing ``make_reader``: an async
factory of ``(reader, writer)``, where ``writer`` is a ``BlockIndex`` whose writes ``reader``
shows (the same object for the memory index; an etcd writer and its mirror for etcd), and
``settle(writer)`` waits until they are visible. Both answer for the model ``MODEL``.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from index.block_index import BlockIndex
from index.hashing import block_hashes
from index.reader import IndexReader

BS = 4
MODEL = "org/reader-model"


def chain_of(n: int, start: int = 0) -> list[int]:
    """Real chained hashes of ``n`` blocks of distinct tokens."""
    return block_hashes(list(range(start, start + n * BS)), BS)


MakeReader = Callable[[], Awaitable[tuple[IndexReader, BlockIndex]]]


class ReaderContract:
    """Behaviour shared by all ``IndexReader`` implementations of one model."""

    async def settle(self, writer: BlockIndex) -> None:
        """Wait until awaited writes are visible to the reader; memory needs nothing."""

    @pytest.fixture
    def make_reader(self) -> MakeReader:  # pragma: no cover - subclasses provide it
        raise NotImplementedError("a ReaderContract subclass must provide make_reader")

    async def test_empty(self, make_reader: MakeReader) -> None:
        reader, _ = await make_reader()
        assert reader.ready and reader.connected
        assert reader.model == MODEL and reader.models() == {MODEL}
        assert reader.match(MODEL, chain_of(4)) == {} and reader.match(MODEL, []) == {}
        assert reader.block_count() == reader.block_count(MODEL) == 0
        assert reader.instance_ids() == frozenset() and reader.instance("a") is None
        st = reader.status()
        assert st.ready and st.connected and st.blocks == 0

    async def test_match_tiers_split_the_matched_prefix_by_medium(
            self, make_reader: MakeReader) -> None:
        reader, writer = await make_reader()
        prompt = chain_of(8)
        await writer.add("a", None, prompt[:3])  # the device (GPU by default)
        await writer.add("a", prompt[2], prompt[3:5], "CPU_PINNED")
        await writer.add("a", prompt[4], prompt[5:6], "DISK")
        await writer.add("b", None, prompt[:2], "CPU")
        await self.settle(writer)
        tiers = reader.match_tiers(MODEL, prompt)
        assert {k: v.as_dict() for k, v in tiers.items()} == {
            "a": {"device": 3, "host": 2, "disk": 1}, "b": {"device": 0, "host": 2, "disk": 0}}
        assert {k: v.blocks for k, v in tiers.items()} == reader.match(MODEL, prompt)
        assert reader.match_tiers("other/model", prompt) == {}

    async def test_match_is_the_longest_prefix_per_instance(self, make_reader: MakeReader) -> None:
        reader, writer = await make_reader()
        prompt = chain_of(8)
        other = chain_of(4, start=1000)
        await writer.add("a", None, prompt[:5])
        await writer.add("b", None, prompt[:3])
        await writer.add("b", prompt[3], prompt[4:6])  # a gap at block 3: b matches 3
        await writer.add("c", None, other)
        await self.settle(writer)
        assert reader.match(MODEL, prompt) == {"a": 5, "b": 3}
        assert reader.match(MODEL, prompt[:2]) == {"a": 2, "b": 2}
        assert reader.match(MODEL, other) == {"c": 4}
        assert reader.match(MODEL, chain_of(1, start=2000) + prompt) == {}, \
            "a prefix starts at the first block"

    async def test_an_unknown_model_answers_nothing_and_is_not_stored(
            self, make_reader: MakeReader) -> None:
        reader, writer = await make_reader()
        prompt = chain_of(3)
        await writer.add("a", None, prompt)
        await self.settle(writer)
        assert reader.match("not/served", prompt) == {}
        assert reader.version("not/served") == 0 and reader.block_count("not/served") == 0
        assert reader.models() == {MODEL}

    async def test_version_changes_with_every_change_and_only_then(
            self, make_reader: MakeReader) -> None:
        reader, writer = await make_reader()
        prompt = chain_of(4)
        v0 = reader.version()
        await writer.add("a", None, prompt)
        await self.settle(writer)
        v1 = reader.version()
        assert v1 != v0 and hash(v1) is not None
        assert reader.version(MODEL) == v1, "one model: the index's version is the model's"
        reader.match(MODEL, prompt)
        assert reader.version() == v1, "reads change nothing"
        await writer.remove("a", prompt[2:])
        await self.settle(writer)
        v2 = reader.version()
        assert v2 not in (v0, v1) and reader.match(MODEL, prompt) == {"a": 2}
        await writer.clear("a")
        await self.settle(writer)
        assert reader.version() not in (v0, v1, v2) and reader.match(MODEL, prompt) == {}

    async def test_instance_detail_and_counts(self, make_reader: MakeReader) -> None:
        reader, writer = await make_reader()
        prompt = chain_of(3)
        t0 = time.time()
        await writer.add("a", None, prompt)
        await writer.add("b", None, prompt[:2])
        await self.settle(writer)
        a = reader.instance("a")
        assert a is not None and a.instance_id == "a" and dict(a.blocks) == {MODEL: 3}
        assert t0 <= a.changed_at <= time.time()
        assert reader.instance_ids() == {"a", "b"}
        # Distinct blocks: the two held by both count once.
        assert reader.block_count() == reader.block_count(MODEL) == reader.status().blocks == 3

        b_changed = reader.instance("b").changed_at  # type: ignore[union-attr]
        await asyncio.sleep(0.02)
        await writer.add("a", prompt[2], chain_of(2, start=500))
        await self.settle(writer)
        a2 = reader.instance("a")
        assert a2 is not None and a2.blocks[MODEL] == 5 and a2.changed_at > a.changed_at
        assert reader.instance("b").changed_at == b_changed  # type: ignore[union-attr]

        await writer.clear("a")
        await self.settle(writer)
        assert reader.instance("a") is None and reader.instance_ids() == {"b"}
        assert reader.block_count() == 2
