"""The block index spread over two real etcd clusters: placement, the writers' shard leases, and
a ``ShardedIndex`` that keeps the live shard live when the other one dies."""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from agent_helpers import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.lease import LeaseSession, cancel_and_wait
from index.mirror import BlockMirror, BlockMirrorConfig
from index.shard_session import BlockSession
from index.sharded import ShardedIndex, open_reader
from index.shards import MAX_SHARDS, IndexShards
from index.writer import BlockWriter
from kvatlas.etcd_proc import EtcdCluster

MODEL = "tiny"


def ids_on(shards: IndexShards, shard: int, n: int) -> list[str]:
    """The first ``n`` ids ``prefill-K`` that ``shards`` places on ``shard``."""
    out = [f"prefill-{k}" for k in range(1000) if shards.place(f"prefill-{k}") == shard]
    return out[:n]


def settings(*texts: str) -> IndexShards:
    return IndexShards.from_texts(list(texts), EtcdSettings(timeout=2.0))


# --- placement and parsing -------------------------------------------------------------------


def test_placement_is_a_stable_function_of_the_id_across_processes() -> None:
    shards = settings(*(f"127.0.0.1:{2379 + 2 * i}" for i in range(4)))
    ids = [f"prefill-{k}" for k in range(200)]
    here = [shards.place(i) for i in ids]
    # Another interpreter, another hash seed: the same shards (str hashing plays no part).
    code = ("from index.etcd import EtcdSettings; from index.shards import IndexShards; "
            "s = IndexShards.from_texts([f'127.0.0.1:{2379 + 2 * i}' for i in range(4)], "
            "EtcdSettings()); print(','.join(str(s.place(f'prefill-{k}')) for k in range(200)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert [int(x) for x in out.split(",")] == here
    assert set(here) == {0, 1, 2, 3}


def test_placement_is_balanced_and_a_new_shard_only_takes_instances() -> None:
    rng = random.Random(7)
    ids = [f"pod-{rng.getrandbits(48):012x}" for _ in range(8000)]
    four = settings(*(f"127.0.0.1:{3000 + i}" for i in range(4)))
    five = settings(*(f"127.0.0.1:{3000 + i}" for i in range(5)))
    before = [four.place(i) for i in ids]
    after = [five.place(i) for i in ids]
    for s in range(4):
        assert abs(before.count(s) - 2000) < 200, before.count(s)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    # Only to the new shard, and about a fifth of them.
    assert all(b == 4 for _, b in moved)
    assert abs(len(moved) - 1600) < 200, len(moved)


def test_one_cluster_or_none_places_everything_on_shard_0() -> None:
    assert IndexShards().place("anything") == 0 and IndexShards().count == 1
    one = settings("127.0.0.1:2379,127.0.0.1:2381")
    assert one.sharded and one.place("x") == 0 and one.clusters[0].endpoints == (
        "127.0.0.1:2379", "127.0.0.1:2381")


def test_shards_inherit_the_main_etcd_credentials_and_tls() -> None:
    base = EtcdSettings(timeout=1.5, user="u", password="p", ca_cert="/ca.pem")
    shards = IndexShards.from_texts(["10.0.0.1:2379", "10.0.0.2:2379"], base)
    assert [c.endpoints for c in shards.clusters] == [("10.0.0.1:2379",), ("10.0.0.2:2379",)]
    assert all(c.user == "u" and c.ca_cert == "/ca.pem" and c.timeout == 1.5
               for c in shards.clusters)


@pytest.mark.parametrize("texts, says", [
    (["127.0.0.1"], "'127.0.0.1' is not HOST:PORT"),
    (["127.0.0.1:99999"], "is not HOST:PORT"),
    ([""], "no etcd endpoint given"),
    (["127.0.0.1:2379", "127.0.0.1:2380,127.0.0.1:2379"], "in shard 0 and shard 1"),
    ([f"127.0.0.1:{3000 + i}" for i in range(MAX_SHARDS + 1)], f"at most {MAX_SHARDS}"),
])
def test_bad_index_etcd_values_name_the_problem(texts: list[str], says: str) -> None:
    with pytest.raises(ValueError, match="index-etcd") as err:
        settings(*texts)
    assert says in str(err.value)


# --- two real clusters -----------------------------------------------------------------------


@pytest.fixture
async def shards(etcd_endpoint: str, etcd_shard: EtcdCluster,
                 key_prefix: str) -> AsyncIterator[IndexShards]:
    """Two shards: the session's etcd and a cluster of this test's own."""
    both = settings(etcd_endpoint, etcd_shard.endpoints)
    yield both
    for c in both.clusters:
        with contextlib.suppress(Exception):
            async with EtcdClient(c) as client:
                await client.delete(key_prefix.encode() + b"/", prefix=True)


class Instance:
    """One instance as a writer of blocks runs it: a lease in the main etcd (for its record)
    and its blocks written under its ``BlockSession`` (as ``index.pipeline`` wires it)."""

    def __init__(self, main: EtcdClient, shards: IndexShards, layout: KeyLayout,
                 instance_id: str) -> None:
        self.id = instance_id
        self.main = LeaseSession(main, ttl=5)
        self.stack = contextlib.AsyncExitStack()
        self.blocks = BlockSession(self.main, shards, instance_id)
        self.stack.push_async_callback(self.blocks.close)
        self.blocks.start()
        self.writer = BlockWriter(self.blocks.session, layout, MODEL, instance_id)
        self.stack.push_async_callback(self.writer.close)
        self.main_task = asyncio.create_task(self.main.run())
        self.writer.start()

    async def close(self) -> None:
        await self.stack.aclose()
        await cancel_and_wait(self.main_task)
        await self.main.revoke()


@pytest.fixture
async def instances(etcd: EtcdClient) -> AsyncIterator[list[Instance]]:
    made: list[Instance] = []
    yield made
    for inst in made:
        await inst.close()


def chain(seed: int, n: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


async def mirrors_of(shards: IndexShards, layout: KeyLayout,
                     stack: contextlib.AsyncExitStack) -> ShardedIndex:
    out = []
    for c in shards.clusters:
        client = EtcdClient(c)
        stack.push_async_callback(client.close)
        m = BlockMirror(client, layout, MODEL, BlockMirrorConfig(progress_every=0.2,
                                                                 stale_after=1.0))
        stack.push_async_callback(m.close)
        m.start()
        out.append(m)
    return ShardedIndex(out)


async def test_blocks_go_to_their_shard_and_one_index_reads_every_shard(
        etcd: EtcdClient, shards: IndexShards, layout: KeyLayout,
        instances: list[Instance]) -> None:
    on0, on1 = ids_on(shards, 0, 2), ids_on(shards, 1, 2)
    for k, iid in enumerate(on0 + on1):
        inst = Instance(etcd, shards, layout, iid)
        instances.append(inst)
        assert inst.blocks.shard == shards.place(iid) and inst.blocks.own
        inst.writer.add(None, chain(k))
    for inst in instances:
        assert await inst.writer.wait_synced(10)

    # Each shard's etcd holds exactly its instances' segments, under their shard leases.
    for shard, ids in ((0, on0), (1, on1)):
        async with EtcdClient(shards.clusters[shard]) as client:
            _, kvs = await client.get_prefix(layout.blocks_prefix(MODEL))
        assert {layout.parse_segment(kv.key)[1] for kv in kvs} == set(ids)
        leases = {inst.blocks.session.lease_id for inst in instances if inst.id in ids}
        assert {kv.lease for kv in kvs} == leases

    async with contextlib.AsyncExitStack() as stack:
        index = await mirrors_of(shards, layout, stack)
        for k, iid in enumerate(on0 + on1):
            blocks = chain(k)
            await wait_until(lambda b=blocks: bool(index.match(MODEL, b)), 10)
            assert index.match(MODEL, blocks) == {iid: 8}
            assert index.match_tiers(MODEL, blocks)[iid].device == 8
        assert index.instance_ids() == frozenset(on0 + on1)
        assert index.block_count(MODEL) == 32 and index.models() == frozenset({MODEL})
        assert [(s.shard, s.state, s.instances, s.status.blocks) for s in index.shards()] == [
            (0, "live", 2, 16), (1, "live", 2, 16)]
        st = index.status()
        assert st.ready and st.connected and st.blocks == 32

        # An instance stopping revokes its shard lease: its blocks leave that shard.
        gone = instances.pop(2)
        await gone.close()
        await wait_until(lambda: index.match(MODEL, chain(2)) == {}, 10)
        assert index.shards()[1].instances == 1


async def test_a_shard_down_leaves_only_its_instances_stale(
        etcd: EtcdClient, shards: IndexShards, layout: KeyLayout, etcd_shard: EtcdCluster,
        instances: list[Instance]) -> None:
    (a,), (b,) = ids_on(shards, 0, 1), ids_on(shards, 1, 1)
    ia, ib = Instance(etcd, shards, layout, a), Instance(etcd, shards, layout, b)
    instances += [ia, ib]
    ia.writer.add(None, chain(1))
    ib.writer.add(None, chain(2))
    async with contextlib.AsyncExitStack() as stack:
        index = await mirrors_of(shards, layout, stack)
        await wait_until(lambda: bool(index.match(MODEL, chain(1))
                                             and index.match(MODEL, chain(2))), 10)
        version = index.version(MODEL)

        etcd_shard.members[0].kill()
        await wait_until(lambda: index.shards()[1].state == "stale", 10)
        st = index.status()
        assert st.ready and not st.connected and "shard 1" in (st.last_error or "")
        assert index.shards()[0].state == "live"
        # Shard 1's instance keeps its last known blocks; shard 0 stays live: a new chain of
        # its instance arrives as before.
        assert index.match(MODEL, chain(2)) == {b: 8}
        ia.writer.add(chain(1)[-1], chain(3))
        await wait_until(lambda: index.match(MODEL, chain(1) + chain(3)) == {a: 16}, 10)
        assert index.version(MODEL) != version

        # Back: the shard reloads and is live again; the instance's writer resyncs to it.
        etcd_shard.members[0].start()
        etcd_shard.members[0].wait_ready()
        ib.writer.add(chain(2)[-1], chain(4))
        await wait_until(lambda: index.shards()[1].state == "live"
                                and index.match(MODEL, chain(2) + chain(4)) == {b: 16}, 20)


async def test_a_shard_never_reached_does_not_hold_the_others_back(
        etcd: EtcdClient, etcd_endpoint: str, layout: KeyLayout,
        instances: list[Instance]) -> None:
    from kvatlas.etcd_proc import free_port
    shards = settings(etcd_endpoint, f"127.0.0.1:{free_port()}")  # nothing listens there
    (a,) = ids_on(shards, 0, 1)
    inst = Instance(etcd, shards, layout, a)
    instances.append(inst)
    inst.writer.add(None, chain(5))
    async with contextlib.AsyncExitStack() as stack:
        index = await mirrors_of(shards, layout, stack)
        await wait_until(lambda: index.match(MODEL, chain(5)) == {a: 8}, 10)
        assert index.ready and not index.connected
        assert [s.state for s in index.shards()] == ["live", "loading"]


async def test_without_shards_blocks_stay_under_the_instance_lease(
        etcd: EtcdClient, layout: KeyLayout, instances: list[Instance]) -> None:
    inst = Instance(etcd, IndexShards(), layout, "p0")
    instances.append(inst)
    assert not inst.blocks.own and inst.blocks.session is inst.main
    inst.writer.add(None, chain(6))
    assert await inst.writer.wait_synced(10)
    _, kvs = await etcd.get_prefix(layout.blocks_prefix(MODEL))
    assert {kv.lease for kv in kvs} == {inst.main.lease_id}


def test_a_sharded_index_follows_one_model() -> None:
    with pytest.raises(ValueError, match="at least one shard"):
        ShardedIndex([])


async def test_shard_mirrors_of_different_models_are_refused(etcd: EtcdClient,
                                                              layout: KeyLayout) -> None:
    a, b = BlockMirror(etcd, layout, "m1"), BlockMirror(etcd, layout, "m2")
    with pytest.raises(ValueError, match="same model"):
        ShardedIndex([a, b])


def test_cli_flag_parses_clusters(etcd_endpoint: str) -> None:
    import argparse
    parser = argparse.ArgumentParser()
    IndexShards.add_cli_args(parser)
    args = parser.parse_args(["--index-etcd", "h1:1,h2:2", "--index-etcd", "h3:3", "h4:4"])
    got = IndexShards.from_cli_args(args, EtcdSettings())
    assert [c.endpoints for c in got.clusters] == [("h1:1", "h2:2"), ("h3:3",), ("h4:4",)]
    assert IndexShards.from_cli_args(parser.parse_args([]), EtcdSettings()) == IndexShards()


async def test_open_reader_reads_every_shard_or_the_main_etcd(
        etcd: EtcdClient, shards: IndexShards, layout: KeyLayout,
        instances: list[Instance]) -> None:
    """``open_reader``, the read side a router opens: one mirror per shard read as one, or the
    main etcd's mirror without shards; everything it opened closes with its stack."""
    on0, on1 = ids_on(shards, 0, 1), ids_on(shards, 1, 1)
    for k, iid in enumerate(on0 + on1):
        inst = Instance(etcd, shards, layout, iid)
        instances.append(inst)
        inst.writer.add(None, chain(k))
    for inst in instances:
        assert await inst.writer.wait_synced(10), f"{inst.id}'s blocks never reached its shard"
    async with contextlib.AsyncExitStack() as stack:
        index = await open_reader(stack, etcd, layout, MODEL, shards)
        assert isinstance(index, ShardedIndex)
        for k, iid in enumerate(on0 + on1):
            blocks = chain(k)
            await wait_until(lambda b=blocks, i=iid: index.match(MODEL, b) == {i: 8},
                             what=f"the reader matches {iid}'s 8 blocks")
        assert len(index.shards()) == 2
    async with contextlib.AsyncExitStack() as stack:
        main = await open_reader(stack, etcd, layout, MODEL, IndexShards())
        assert isinstance(main, BlockMirror)
        await wait_until(lambda: main.status().ready, what="the main-etcd mirror loaded")
