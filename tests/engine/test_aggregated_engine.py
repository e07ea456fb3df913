"""A monolithic engine started with --etcd is an aggregated instance of the cluster: its record
(role aggregated, url, model, tokenizer, limits) and its prefix cache's blocks are in etcd under
one lease, revoked at a clean stop; without a free instance id it does not start."""
from __future__ import annotations

import aiohttp
import aiohttp.web
import pytest
from engine_helpers import wait_indexed
from pd_procs import Proc
from waiting import wait_until

from engine.aggregated import AggregatedConfig
from engine.serve_config import EngineServerConfig
from engine.server import create_app
from index.access import ClusterAccess
from index.errors import InstanceIdInUse
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from index.record import AGGREGATED, InstanceRecord
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(90)


async def test_aggregated_engine_registers_indexes_and_leaves(
        etcd_endpoint: str, key_prefix: str, etcd: EtcdClient) -> None:
    layout = KeyLayout(prefix=key_prefix)
    # a TTL far longer than any wait here: keys gone at the stop were revoked, not expired
    engine = Proc("monolithic", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
                  "--lease-ttl", "30", "--instance-id", "agg-a")
    try:
        engine.wait_ready()

        async def ready_record() -> InstanceRecord | None:
            kv = await etcd.get(layout.instance("agg-a"))
            rec = None if kv is None else InstanceRecord.from_json(kv.value)
            return rec if rec is not None and rec.ready else None
        await wait_until(ready_record, what="the engine's record says ready", timeout=20.0,
                         interval=0.2)
        rec = await ready_record()
        assert rec is not None
        assert rec.role == AGGREGATED and rec.url == engine.url and rec.model == "tiny"
        assert rec.engine == "kvatlas" and rec.page_size == 16 and rec.block_size == 16
        assert rec.max_running_requests == 256
        assert rec.max_total_num_tokens == 1024 * 16
        assert rec.max_prompt_tokens and rec.context_length
        assert isinstance(rec.tokenizer, dict) and rec.tokenizer.get("source")

        ids = [256, *b"an aggregated prompt, long enough for two full blocks of KV"]
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            async with s.post(engine.url + "/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
        await wait_indexed(etcd, layout, "agg-a", ids)
        record_kv = await etcd.get(layout.instance("agg-a"))
        _, segments = await etcd.get_prefix(layout.blocks_prefix("tiny", "agg-a"))
        assert record_kv is not None
        assert {kv.lease for kv in segments} == {record_kv.lease}

        engine.stop()  # SIGTERM: a clean stop revokes the lease
        _, left = await etcd.get_prefix(layout.blocks_prefix("tiny", "agg-a"))
        assert not left, "blocks left after a clean stop"
        assert await etcd.get(layout.instance("agg-a")) is None, "record left after the stop"
    finally:
        engine.stop()


async def test_a_start_refused_for_a_live_id_closes_what_it_opened(
        etcd_settings: EtcdSettings, key_prefix: str, etcd: EtcdClient) -> None:
    """A second engine with a live instance's id is refused (InstanceIdInUse) and leaves the
    first one's record as it was."""
    # The claim watches a held lease for ttl / 3 (+ slack) to see it renewed: a short TTL.
    access = ClusterAccess(etcd=etcd_settings, prefix=key_prefix, lease_ttl=6)
    port = free_port()

    def app(iid: str) -> aiohttp.web.Application:
        engine = EngineServerConfig(num_pages=64, port=port)
        return create_app(engine, AggregatedConfig(engine=engine, access=access,
                                                   instance_id=iid))
    runner_a = aiohttp.web.AppRunner(app("agg-dup"))
    await runner_a.setup()
    try:
        # the holder listens where its record says: the claim sees a live process there
        await aiohttp.web.TCPSite(runner_a, "127.0.0.1", port).start()
        key = KeyLayout(prefix=key_prefix).instance("agg-dup")

        async def recorded() -> bool:
            return await etcd.get(key) is not None
        await wait_until(recorded, what="the first engine's record is written", timeout=20.0,
                         interval=0.1)
        before = await etcd.get(key)
        assert before is not None
        runner_b = aiohttp.web.AppRunner(app("agg-dup"))
        with pytest.raises(InstanceIdInUse):
            await runner_b.setup()
        await runner_b.cleanup()
        after = await etcd.get(key)
        assert after is not None and after.lease == before.lease
    finally:
        await runner_a.cleanup()
    assert await etcd.get(key) is None, "record left after the first engine stopped"
