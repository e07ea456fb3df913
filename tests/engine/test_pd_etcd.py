"""A prefill and a decode started with --etcd: the prefill's instance record (with its HTTP url)
and rank table come from its bootstrap mirror, its prefix-cache blocks are indexed under the same
lease, the decode registers its own record, and the router can parse both. Killing the prefill
lets its lease expire and every key of it vanish."""
from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pd_helpers import pd_body
from pd_procs import Proc
from waiting import wait_until

from index.etcd import EtcdClient, EtcdSettings
from index.hashing import BASE_SEED, block_hashes
from index.keys import KeyLayout
from index.segments import held_blocks
from index.shards import IndexShards
from router.workers import parse_instance_record

pytestmark = pytest.mark.timeout(90)


async def generate(prefill: Proc, decode: Proc, ids: list[int]) -> None:
    """One PD request (3 new tokens) to both halves, both answered 200."""
    async with aiohttp.ClientSession() as s:
        body = pd_body(ids, 3, prefill.bport)
        pr, dr = await asyncio.gather(s.post(prefill.url + "/generate", json=body),
                                      s.post(decode.url + "/generate", json=body))
        assert pr.status == 200 and dr.status == 200


async def test_prefill_and_decode_register_and_index(etcd_endpoint: str, key_prefix: str,
                                                     etcd: EtcdClient) -> None:
    layout = KeyLayout(prefix=key_prefix)
    common = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix, "--lease-ttl", "3")
    prefill = Proc("prefill", *common, "--instance-id", "pre-a")
    decode = Proc("decode", *common, "--instance-id", "dec-a")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        ids = [256, *b"an indexed prompt, long enough for two full blocks of KV"]
        await generate(prefill, decode, ids)
        want = block_hashes(ids, 16, BASE_SEED)
        assert len(want) >= 2

        async def indexed() -> bool:
            _, kvs = await etcd.get_prefix(layout.blocks_prefix("tiny", "pre-a"))
            return set(held_blocks(kv.value for kv in kvs)) >= set(want)
        await wait_until(indexed, what="the prompt's blocks are indexed", timeout=20.0,
                         interval=0.2)

        pre = await etcd.get(layout.instance("pre-a"))
        dec = await etcd.get(layout.instance("dec-a"))
        assert pre is not None and dec is not None
        prec = parse_instance_record("pre-a", pre.value)
        decr = parse_instance_record("dec-a", dec.value)
        assert prec is not None and prec["role"] == "prefill" and prec["url"] == prefill.url
        assert prec["bootstrap_port"] == prefill.bport and prec["ready"]
        assert decr is not None and decr["role"] == "decode" and decr["url"] == decode.url
        assert json.loads(dec.value)["model"] == "tiny"
        _, ranks = await etcd.get_prefix(layout.ranks_prefix("pre-a"))
        assert len(ranks) == 1
        # blocks and record share one lease: a dead prefill's keys all vanish together
        _, segments = await etcd.get_prefix(layout.blocks_prefix("tiny", "pre-a"))
        assert {kv.lease for kv in segments} == {pre.lease}
        prefill.kill()

        async def gone() -> bool:
            _, left = await etcd.get_prefix(layout.blocks_prefix("tiny", "pre-a"))
            return not left and await etcd.get(layout.instance("pre-a")) is None
        await wait_until(gone, what="the killed prefill's keys leave etcd", timeout=15.0,
                         interval=0.2)
    finally:
        prefill.stop()
        decode.stop()


async def test_dp2_prefill_indexes_both_groups_caches(etcd_endpoint: str, key_prefix: str,
                                                      etcd: EtcdClient) -> None:
    """Rooms 2k and 2k+1 land on DP groups 0 and 1 (follow_bootstrap_room); the blocks of both
    groups' prefix caches appear under the one instance."""
    layout = KeyLayout(prefix=key_prefix)
    common = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix, "--lease-ttl", "3")
    prefill = Proc("prefill", "--dp", "2", *common, "--instance-id", "pre-dp")
    decode = Proc("decode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        prompts = {0: [256, *b"group zero holds this prompt, two blocks of it at least"],
                   1: [256, *b"group one holds this other prompt, also two blocks long"]}
        async with aiohttp.ClientSession() as s:
            for dp, ids in prompts.items():
                body = pd_body(ids, 2, prefill.bport, room=1000 + dp)
                pr, dr = await asyncio.gather(s.post(prefill.url + "/generate", json=body),
                                              s.post(decode.url + "/generate", json=body))
                assert pr.status == 200 and dr.status == 200, await pr.text()
        want = {h for ids in prompts.values() for h in block_hashes(ids, 16, BASE_SEED)}

        async def indexed() -> bool:
            _, kvs = await etcd.get_prefix(layout.blocks_prefix("tiny", "pre-dp"))
            return set(held_blocks(kv.value for kv in kvs)) >= want
        await wait_until(indexed, what="the prompt's blocks are indexed", timeout=20.0,
                         interval=0.2)
    finally:
        prefill.stop()
        decode.stop()


def rank_children(pid: int) -> list[int]:
    """The rank processes a leader spawned: its children that run multiprocessing's spawn
    entry point (not its resource tracker)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


async def tp2_prefill(etcd_endpoint: str, key_prefix: str, etcd: EtcdClient,
                      iid: str) -> Proc:
    """A ready two-rank prefill registered in etcd, with a lease TTL (30 s) far longer than any
    wait of these tests, so that a key gone at once was revoked, not expired."""
    prefill = Proc("prefill", "--tp", "2", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
                   "--lease-ttl", "30", "--instance-id", iid)
    try:
        prefill.wait_ready()
        assert await etcd.get(KeyLayout(prefix=key_prefix).instance(iid)) is not None
    except BaseException:
        prefill.stop()
        raise
    return prefill


async def test_a_dead_rank_takes_its_instance_down_and_out_of_etcd(
        etcd_endpoint: str, key_prefix: str, etcd: EtcdClient) -> None:
    layout = KeyLayout(prefix=key_prefix)
    prefill = await tp2_prefill(etcd_endpoint, key_prefix, etcd, "pre-tp")
    try:
        (rank1,) = rank_children(prefill.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        # Gone from etcd at once (the lease is revoked), not after its 30 s TTL.
        async def gone() -> bool:
            return await etcd.get(layout.instance("pre-tp")) is None
        # 20 s: the revoke, not the 30 s TTL, takes it away.
        await wait_until(gone, what="the record leaves etcd", timeout=20.0, interval=0.2)
        assert await asyncio.get_running_loop().run_in_executor(None, prefill.proc.wait, 20) == 1
        assert "rank process kvatlas-rank1 exited" in prefill.output()
    finally:
        prefill.stop()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
async def test_a_second_server_with_a_live_id_exits_naming_the_first(
        etcd_endpoint: str, key_prefix: str, mode: str) -> None:
    common = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix, "--lease-ttl", "3",
              "--instance-id", f"{mode}-dup")
    first = Proc(mode, *common)
    second = None
    try:
        first.wait_ready()
        second = Proc(mode, *common)
        code = await asyncio.get_running_loop().run_in_executor(None, second.proc.wait, 30)
        assert code == 2
        out = second.output()
        assert f"instance id '{mode}-dup' is in use by a live process" in out
        assert f"{mode} at 127.0.0.1:{first.port}" in out
        assert "Traceback" not in out and "Unclosed" not in out
    finally:
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.parametrize("whole_group", [True, False], ids=["group", "leader"])
async def test_a_clean_stop_with_ranks_is_not_taken_for_a_dead_rank(
        etcd_endpoint: str, key_prefix: str, etcd: EtcdClient, whole_group: bool) -> None:
    """SIGTERM to the process group (``cluster down``) or to the leader alone: exit 0, and the
    lease revoked at once, however the ranks end around the leader's own stop."""
    layout = KeyLayout(prefix=key_prefix)
    prefill = await tp2_prefill(etcd_endpoint, key_prefix, etcd, "pre-stop")
    try:
        if whole_group:
            os.killpg(prefill.proc.pid, signal.SIGTERM)
        else:
            prefill.proc.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, prefill.proc.wait, 30)
        assert code == 0, prefill.output()
        assert "rank process" not in prefill.output()
        assert await etcd.get(layout.instance("pre-stop")) is None  # revoked, not expiring
    finally:
        prefill.stop()


async def test_a_prefill_with_index_shards_writes_its_blocks_to_its_shard(
        etcd_endpoint: str, key_prefix: str, etcd: EtcdClient, etcd_shard: Any) -> None:
    layout = KeyLayout(prefix=key_prefix)
    shards = IndexShards.from_texts([etcd_endpoint, etcd_shard.endpoints], EtcdSettings())
    iid = next(f"pre-{k}" for k in range(100) if shards.place(f"pre-{k}") == 1)
    prefill = Proc("prefill", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
                   "--lease-ttl", "3", "--instance-id", iid,
                   "--index-etcd", etcd_endpoint, etcd_shard.endpoints)
    decode = Proc("decode")
    shard = EtcdClient(shards.clusters[1])
    try:
        prefill.wait_ready()
        decode.wait_ready()
        ids = [256, *b"a prompt indexed on the second shard, two blocks long"]
        await generate(prefill, decode, ids)
        want = set(block_hashes(ids, 16, BASE_SEED))

        async def indexed() -> bool:
            _, kvs = await shard.get_prefix(layout.blocks_prefix("tiny", iid))
            return set(held_blocks(kv.value for kv in kvs)) >= want
        await wait_until(indexed, what="the prompt's blocks are indexed", timeout=20.0,
                         interval=0.2)
        _, on_main = await etcd.get_prefix(layout.blocks_prefix())
        assert on_main == []
        record = await etcd.get(layout.instance(iid))
        _, kvs = await shard.get_prefix(layout.blocks_prefix("tiny", iid))
        assert record is not None and {kv.lease for kv in kvs} != {record.lease}
        prefill.kill()  # both leases expire: the blocks leave the shard with the record

        async def gone() -> bool:
            _, left = await shard.get_prefix(layout.blocks_prefix("tiny", iid))
            return not left and await etcd.get(layout.instance(iid)) is None
        await wait_until(gone, what="the killed prefill's keys leave etcd", timeout=15.0,
                         interval=0.2)
    finally:
        await shard.close()
        prefill.stop()
        decode.stop()
