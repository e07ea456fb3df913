"""The contract every ``BlockIndex`` backend must meet (not collected on its own).

Reuse it by subclassing in a ``test_*.py`` module::

    from block_index_contract import BlockIndexContract

    class TestMyIndex(BlockIndexContract):
        @pytest.fixture
        async def make_index(self, ...):
            made = []
            async def make():
                idx = MyIndex(...)
                made.append(idx)
                return idx
            yield make
            for idx in made: await idx.close()

        async def settle(self, index):      # optional: wait until writes are visible to reads
            await index.wait_visible()

``make_index`` yields an async factory so that a backend may need set-up (etcd, writers, mirrors)
and tear it down itself. ``settle`` is awaited after every batch of writes and before reads, so an
eventually consistent backend (etcd writer + watched mirror) can wait for its mirror to catch up.
A backend also exposes ``medium(instance, hash) -> str | None``.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from index.block_index import BlockIndex
from index.hashing import block_hashes

BS = 4


def chain_of(n: int, start: int = 0, parent: int | None = None) -> list[int]:
    """Real chained hashes of ``n`` blocks of distinct tokens."""
    return block_hashes(list(range(start, start + n * BS)), BS, parent=parent)


MakeIndex = Callable[[], Awaitable[BlockIndex]]


class BlockIndexContract:
    """Behaviour shared by all ``BlockIndex`` backends."""

    async def settle(self, index: BlockIndex) -> None:
        """Wait until writes already awaited are visible to ``lookup``; memory needs nothing."""

    @pytest.fixture
    def make_index(self) -> MakeIndex:  # pragma: no cover - subclasses provide it
        raise NotImplementedError("a BlockIndexContract subclass must provide make_index")

    async def test_empty_prompt_and_empty_index(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        hs = chain_of(4)
        assert idx.lookup([]) == {}
        assert idx.lookup(hs) == {}
        await idx.add("a", None, hs)
        await self.settle(idx)
        assert idx.lookup([]) == {}
        assert idx.instances() == {"a"}

    async def test_add_then_lookup_is_prefix_match(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(8)
        await idx.add("a", None, prompt[:5])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 5}
        assert idx.lookup(prompt[:3]) == {"a": 3}
        assert idx.blocks("a") == set(prompt[:5])

    async def test_add_with_parent_continues_chain(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(6)
        await idx.add("a", None, prompt[:2])
        await idx.add("a", prompt[1], prompt[2:6])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 6}

    async def test_first_block_missing_means_no_match(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(6)
        await idx.add("a", prompt[0], prompt[1:])
        await self.settle(idx)
        assert idx.lookup(prompt) == {}
        assert idx.lookup(prompt[1:]) == {"a": 5}

    async def test_stops_at_first_gap(self, make_index: MakeIndex) -> None:
        """Blocks after a missing one are never counted (the early exit must not skip ahead)."""
        idx = await make_index()
        prompt = chain_of(10)
        await idx.add("a", None, prompt[:3])
        await idx.add("a", prompt[3], prompt[4:])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 3}

    async def test_remove_middle_block_truncates(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(8)
        await idx.add("a", None, prompt)
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 8}
        await idx.remove("a", [prompt[4]])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 4}
        assert prompt[4] not in idx.blocks("a")
        await idx.remove("a", [prompt[0]])
        await self.settle(idx)
        assert idx.lookup(prompt) == {}

    async def test_clear_forgets_one_instance_only(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(5)
        await idx.add("a", None, prompt)
        await idx.add("b", None, prompt[:2])
        await self.settle(idx)
        await idx.clear("a")
        await self.settle(idx)
        assert idx.lookup(prompt) == {"b": 2}
        assert idx.blocks("a") == set()
        assert idx.instances() == {"b"}
        await idx.clear("b")
        await idx.clear("never-seen")
        await self.settle(idx)
        assert idx.lookup(prompt) == {}
        assert idx.instances() == set()

    async def test_multiple_instances_each_get_their_own_length(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(12)
        other = chain_of(12, start=10_000)
        await idx.add("long", None, prompt)
        await idx.add("short", None, prompt[:3])
        await idx.add("mid", None, prompt[:7])
        await idx.add("elsewhere", None, other)
        await self.settle(idx)
        assert idx.lookup(prompt) == {"long": 12, "short": 3, "mid": 7}
        assert idx.lookup(other) == {"elsewhere": 12}
        assert idx.instances() == {"long", "short", "mid", "elsewhere"}

    async def test_unknown_hashes_are_ignored_by_remove(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(4)
        await idx.add("a", None, prompt)
        await self.settle(idx)
        await idx.remove("a", chain_of(3, start=5_000))
        await idx.remove("nobody", prompt)
        await idx.remove("a", [])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 4}
        assert idx.instances() == {"a"}

    async def test_remove_on_one_instance_keeps_the_other(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(4)
        await idx.add("a", None, prompt)
        await idx.add("b", None, prompt)
        await self.settle(idx)
        await idx.remove("a", [prompt[1]])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 1, "b": 4}

    async def test_add_is_idempotent(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(4)
        for _ in range(3):
            await idx.add("a", None, prompt)
        await idx.add("a", None, prompt[:2])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 4}
        assert idx.blocks("a") == set(prompt)
        await idx.remove("a", [prompt[2]])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 2}

    async def test_full_uint64_hash_range(self, make_index: MakeIndex) -> None:
        """0, values with the top bit set and 2^64-1 are ordinary keys (no sign trouble)."""
        idx = await make_index()
        prompt = [0, 2**63, 2**64 - 1, 1]
        await idx.add("a", None, prompt)
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 4}
        assert idx.blocks("a") == set(prompt)

    async def test_medium_is_recorded(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(4)
        await idx.add("a", None, prompt[:2])
        await idx.add("a", prompt[1], prompt[2:], medium="CPU_PINNED")
        await self.settle(idx)
        medium = idx.medium  # type: ignore[attr-defined]
        assert [medium("a", h) for h in prompt] == ["GPU", "GPU", "CPU_PINNED", "CPU_PINNED"]
        assert medium("b", prompt[0]) is None
        # A block offloaded elsewhere is still a prefix hit.
        assert idx.lookup(prompt) == {"a": 4}
        await idx.add("a", prompt[1], prompt[2:3])  # back on the GPU
        await self.settle(idx)
        assert medium("a", prompt[2]) == "GPU"
        assert medium("a", prompt[3]) == "CPU_PINNED"

    async def test_instance_reappears_after_clear(self, make_index: MakeIndex) -> None:
        idx = await make_index()
        prompt = chain_of(3)
        await idx.add("a", None, prompt)
        await idx.add("b", None, prompt[:1])
        await self.settle(idx)
        await idx.clear("a")
        await self.settle(idx)
        await idx.add("c", None, prompt[:2])
        await idx.add("a", None, prompt[:3])
        await self.settle(idx)
        assert idx.lookup(prompt) == {"a": 3, "b": 1, "c": 2}
