"""The sidecar in-process, against real etcd and real sockets: waiting for an engine, refusing a
bootstrap URL that does not speak SGLang's wire, mirroring a bootstrap table's changes, health
and the grace, one id per sidecar, and KV events of another block size."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from sidecar_stubs import BootstrapStub, EngineStub, rank_body
from waiting import wait_until

from bootstrap.registration import put_route
from index.agent_stats import stats_key
from index.errors import InstanceIdInUse
from index.etcd import EtcdClient, EtcdSettings
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.events.types import BlockStored
from index.hashing import block_hashes
from index.keys import KeyLayout, loads
from index.record import InstanceRecord
from index.segments import held_blocks
from index.shards import IndexShards
from kvatlas.etcd_proc import free_port
from sidecar.config import SidecarConfig
from sidecar.errors import SidecarError
from sidecar.service import ATTACHED, Sidecar


def config(etcd_settings: EtcdSettings, key_prefix: str, engine_url: str, role: str = "decode",
           **kw: Any) -> SidecarConfig:
    return SidecarConfig(instance_id=kw.pop("instance_id", "e0"), role=role,
                         engine_url=engine_url, model="tiny", etcd=etcd_settings,
                         etcd_prefix=key_prefix, lease_ttl=3, health_interval=0.2,
                         health_timeout=0.5, unhealthy_grace=kw.pop("grace", 30.0),
                         bootstrap_poll=0.2, **kw)


@contextlib.asynccontextmanager
async def running(cfg: SidecarConfig) -> AsyncIterator[tuple[Sidecar, asyncio.Task[None]]]:
    sc = Sidecar(cfg)
    await sc.start()
    stop = asyncio.Event()
    task = asyncio.create_task(sc.run(stop))
    try:
        yield sc, task
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await sc.close()


def consecutive_free_ports() -> int:
    """A free loopback port whose successor is free too (rank r publishes on port + r)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


def record_of(etcd: EtcdClient, layout: KeyLayout, iid: str = "e0"
              ) -> Callable[[], Awaitable[InstanceRecord | None]]:
    async def read() -> InstanceRecord | None:
        kv = await etcd.get(layout.instance(iid))
        return None if kv is None else InstanceRecord.from_json(kv.value)
    return read


async def test_waits_for_an_unreachable_engine_and_says_what_it_waits_for(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str, layout: KeyLayout,
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    engine = EngineStub(port=port)
    caplog.set_level(logging.INFO, logger="sidecar.service")
    async with running(config(etcd_settings, key_prefix, engine.url)) as (sc, task):
        def said() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if "waiting for engine" in r.getMessage()]
        # Tried twice, and still waiting: an unreachable engine is no reason to give up.
        await wait_until(lambda: len(said()) >= 2, what="the sidecar tries its engine twice",
                         detail=lambda: caplog.text)
        assert not task.done() and sc.state == "waiting"
        assert await record_of(etcd, layout)() is None
        waits = said()
        assert waits and f"{engine.url} to answer GET /health" in waits[0], waits
        assert "try 1" in waits[0]
        await engine.start()
        try:
            await wait_until(record_of(etcd, layout), what="the sidecar writes its record")
            rec = await record_of(etcd, layout)()
            assert rec is not None and (rec.role, rec.url, rec.ready, rec.healthy,
                                        rec.engine) == ("decode", engine.url, True, True,
                                                        "sglang")
        finally:
            await engine.stop()


@pytest.mark.parametrize(("route", "named"), [
    ((200, {"hello": "world"}), "lacks attn_tp_size"),
    ((200, {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": "two", "pp_size": 1,
            "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": True}),
     "dp_size"),
    ((404, "404: Not Found"), "answered 404"),
])
async def test_a_bootstrap_url_that_is_not_sglangs_topology_document_is_an_error_naming_it(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str, layout: KeyLayout,
        route: tuple[int, Any], named: str) -> None:
    engine = await EngineStub().start()
    engine.route = route
    try:
        cfg = config(etcd_settings, key_prefix, engine.url, role="prefill",
                     bootstrap_url=engine.url)
        async with running(cfg) as (_, task):
            with pytest.raises(SidecarError) as err:
                await asyncio.wait_for(task, 10)
        assert "--bootstrap-url" in str(err.value) and named in str(err.value), err.value
        assert await record_of(etcd, layout)() is None  # nothing left behind
    finally:
        await engine.stop()


async def test_registration_reregistration_and_a_new_address_reach_etcd_within_2s(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    boot = await BootstrapStub("e0").start()
    try:
        cfg = config(etcd_settings, key_prefix, engine.url, role="prefill",
                     bootstrap_url=boot.url)
        async with running(cfg):
            read = record_of(etcd, layout)
            await wait_until(read, what="the sidecar writes its record")
            rec = await read()
            assert rec is not None and not rec.ready and rec.registered_ranks == 0  # 503

            async def ranks() -> dict[tuple[int, ...], tuple[str, int]]:
                _, kvs = await etcd.get_prefix(layout.ranks_prefix("e0"))
                return {layout.parse_rank(kv.key)[1]: (loads(kv.value)["rank_ip"],
                                                      loads(kv.value)["rank_port"]) for kv in kvs}

            await put_route(boot.url, rank_body(0, 2, 21000))
            await put_route(boot.url, rank_body(1, 2, 21001))

            async def both() -> bool:
                rec = await read()
                return bool(rec and rec.ready) and await ranks() == {
                    (0, 0, 0, 0): ("127.0.0.1", 21000), (0, 0, 1, 0): ("127.0.0.1", 21001)}
            await wait_until(both, what="the record is ready with both ranks' addresses")
            rec = await read()
            assert rec is not None and (rec.expected_ranks, rec.registered_ranks, rec.tp_size,
                                        rec.kv_cache_dtype) == (2, 2, 2, "bfloat16")
            await put_route(boot.url, rank_body(1, 2, 21001))  # re-registration: unchanged
            await put_route(boot.url, rank_body(1, 2, 21999, ip="127.0.0.2"))  # a new address

            async def moved() -> bool:
                return (await ranks()).get((0, 0, 1, 0)) == ("127.0.0.2", 21999)
            await wait_until(moved, what="rank 1's new address replaces its old one")
    finally:
        await boot.stop()
        await engine.stop()


async def test_unhealthy_then_lease_revoked_after_the_grace_and_back_when_it_answers(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    read = record_of(etcd, layout)
    try:
        async with running(config(etcd_settings, key_prefix, engine.url, grace=1.5)) as (sc, _):
            await wait_until(read, what="the sidecar writes its record")
            first = await read()
            assert first is not None and first.healthy
            engine.health_status = 503

            async def unhealthy() -> bool:
                rec = await read()
                return rec is not None and not rec.healthy
            await wait_until(unhealthy, what="the record says unhealthy")
            rec = await read()
            assert rec is not None and rec.ready  # ready and healthy are told apart

            async def gone() -> bool:
                return await read() is None
            await wait_until(gone, what="the record leaves etcd")  # after the grace: lease revoked

            async def waiting() -> bool:
                # The record goes with the revoke, a moment before the sidecar's state moves.
                return sc.state == "waiting"
            await wait_until(waiting, what="the sidecar waits for its engine again")
            engine.health_status = 200

            async def back() -> bool:
                rec = await read()
                return rec is not None and rec.healthy
            await wait_until(back, what="the record is back, healthy")
            again = await read()
            assert again is not None and first.started_at is not None
            assert again.started_at is not None and again.started_at > first.started_at
            assert sc.attachments == 2 and sc.state == ATTACHED
    finally:
        await engine.stop()


async def test_a_second_sidecar_for_one_instance_id_refuses_to_start(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    try:
        cfg = config(etcd_settings, key_prefix, engine.url)
        async with running(cfg):
            await wait_until(record_of(etcd, layout), what="the sidecar writes its record")
            second = Sidecar(config(etcd_settings, key_prefix, engine.url))
            with pytest.raises(InstanceIdInUse):
                await second.start()
            await second.close()
            assert await record_of(etcd, layout)() is not None  # the first one's, untouched
    finally:
        await engine.stop()


async def test_events_of_every_dp_rank_are_indexed_and_another_block_size_is_rejected(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    boot = await BootstrapStub("e0").start()
    await put_route(boot.url, rank_body(0, 1, 21000))
    port = consecutive_free_ports()
    endpoint = f"tcp://127.0.0.1:{port}"
    cfg = config(etcd_settings, key_prefix, engine.url, role="prefill", bootstrap_url=boot.url,
                 events=SubscriberConfig(endpoint=endpoint), dp_size=2)
    publishers = [KVEventPublisher(PublisherConfig(endpoint=f"tcp://127.0.0.1:{port + r}"))
                  for r in range(2)]
    try:
        # Publishing engines connect (and retry) before their sidecar binds, as SGLang's do.
        for pub in publishers:
            await pub.start()
        async with running(cfg) as (sc, _):
            # The record waits for both publishers: from then on nothing published is lost.
            await wait_until(record_of(etcd, layout), what="the sidecar writes its record")
            assert sc.attachment is not None
            assert [s.publishers for _, s in sc.attachment.subscribed] == [1, 1]
            publishers[0].drain([BlockStored([11], None, list(range(16)), 16)])
            publishers[1].drain([BlockStored([22], None, list(range(100, 116)), 16)])
            publishers[1].drain([BlockStored([33], None, list(range(8)), 8)])

            async def counted() -> dict[str, Any] | None:
                kv = await etcd.get(stats_key(layout, "e0"))
                doc = loads(kv.value) if kv is not None else None
                return doc if doc and doc.get("received") == 3 and doc["blocks"] == 2 else None
            doc = await wait_until(counted, what="the stats count 3 batches received and 2 blocks")
            assert doc is not None and doc["rejected"] == {"block_size_mismatch": 1}
            assert doc["applied"] == 2 and doc["last_seq"] == [0, 1]
            _, kvs = await etcd.get_prefix(layout.blocks_prefix("tiny", "e0"))
            assert set(held_blocks(kv.value for kv in kvs)) == {
                block_hashes(list(range(16)), 16)[0], block_hashes(list(range(100, 116)), 16)[0]}
            # one block from each DP rank, one instance
            assert sc.attachment is not None
            shown = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "kvatlas", "index", "stats", "--etcd",
                                 etcd_settings.display, "--etcd-prefix", key_prefix],
                capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            assert "block_size_mismatch 1" in shown.stdout, shown.stdout
    finally:
        for pub in publishers:
            await pub.close()
        await boot.stop()
        await engine.stop()


async def test_a_kv_event_port_in_use_is_an_error_naming_it(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    boot = await BootstrapStub("e0").start()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    try:
        cfg = config(etcd_settings, key_prefix, engine.url, role="prefill",
                     bootstrap_url=boot.url, events=SubscriberConfig(endpoint=endpoint))
        async with running(cfg) as (_, task):
            with pytest.raises(SidecarError) as err:
                await asyncio.wait_for(task, 10)
        assert f"cannot bind KV-event endpoint {endpoint}" in str(err.value), err.value
        assert await record_of(etcd, layout)() is None  # the lease it took is revoked
    finally:
        taken.close()
        await boot.stop()
        await engine.stop()


async def test_a_bootstrap_server_answering_5xx_is_not_ready_not_fatal(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str,
        layout: KeyLayout) -> None:
    engine = await EngineStub().start()
    engine.route = (502, "bad gateway")
    try:
        cfg = config(etcd_settings, key_prefix, engine.url, role="prefill",
                     bootstrap_url=engine.url)
        async with running(cfg) as (sc, task):
            read = record_of(etcd, layout)
            await wait_until(read, what="the sidecar writes its record")
            ranks = sc.attachment.ranks if sc.attachment is not None else None
            assert ranks is not None
            # Polled the 5xx bootstrap server again and again, and still serving, not ready.
            await wait_until(lambda: ranks.polls >= 3,
                             what="the sidecar polls the 5xx bootstrap server 3 times")
            rec = await read()
            assert not task.done() and sc.state == ATTACHED
            assert rec is not None and not rec.ready and rec.registered_ranks == 0
    finally:
        await engine.stop()


async def test_with_index_shards_blocks_go_to_the_instances_shard_under_a_lease_of_their_own(
        etcd: EtcdClient, etcd_settings: EtcdSettings, key_prefix: str, layout: KeyLayout,
        etcd_shard: Any) -> None:
    shards = IndexShards.from_texts([etcd_settings.display, etcd_shard.endpoints],
                                    etcd_settings)
    iid = next(f"e{k}" for k in range(100) if shards.place(f"e{k}") == 1)
    engine = await EngineStub().start()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    cfg = config(etcd_settings, key_prefix, engine.url, role="prefill", instance_id=iid,
                 events=SubscriberConfig(endpoint=endpoint), index_etcd=shards)
    pub = KVEventPublisher(PublisherConfig(endpoint=endpoint))
    await pub.start()
    shard = EtcdClient(shards.clusters[1])
    try:
        async with running(cfg) as (sc, _):
            await wait_until(record_of(etcd, layout, iid), what="the sidecar writes its record")
            pub.drain([BlockStored([11], None, list(range(16)), 16)])

            async def on_shard() -> list[Any]:
                _, kvs = await shard.get_prefix(layout.blocks_prefix("tiny", iid))
                return kvs
            kvs = await wait_until(on_shard, what="the block is on the instance's shard")
            assert set(held_blocks(kv.value for kv in kvs)) == {
                block_hashes(list(range(16)), 16)[0]}
            record = await etcd.get(layout.instance(iid))
            assert record is not None and kvs[0].lease != record.lease
            _, main = await etcd.get_prefix(layout.blocks_prefix())
            assert main == []
        # Closed: both leases revoked, the blocks leave the shard with the record.
        assert await on_shard() == [] and await record_of(etcd, layout, iid)() is None
    finally:
        await shard.close()
        await pub.close()
        await engine.stop()
