"""The index agent end to end: real ZMQ publishers (vLLM-style and SGLang-style batches), real
etcd, a real BlockMirror reading what the agent wrote, and the real CLI querying it."""
from __future__ import annotations

import asyncio
import json

import pytest
import zmq
from agent_helpers import closers, eventually, publish_all, run_cli, tcp  # noqa: F401
from kv_sim import SimEngine
from waiting import wait_until

from index.agent import AgentConfig, AgentError, IndexAgent
from index.agent_stats import stats_key
from index.etcd import EtcdClient, EtcdSettings
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.hashing import block_hashes
from index.keys import KeyLayout, dumps, loads
from index.mirror import BlockMirror

pytestmark = pytest.mark.timeout(60)

BS = 16
MODEL = "org/agent-model"  # a '/' in the model name must survive the key path
PROMPT = list(range(1000, 1000 + 8 * BS + 5))  # 8 full blocks and a partial one


def agent_config(etcd_endpoint: str, key_prefix: str, instance_id: str, endpoint: str,
                 replay: str | None) -> AgentConfig:
    return AgentConfig(instance_id=instance_id, model=MODEL,
                       events=SubscriberConfig(endpoint=endpoint, replay_endpoint=replay),
                       etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0),
                       etcd_prefix=key_prefix, lease_ttl=5, stats_interval=0.1,
                       record_check_interval=0.1)


async def start_pair(closers: list, etcd_endpoint: str, key_prefix: str, instance_id: str,
                     encoding: str) -> tuple[IndexAgent, KVEventPublisher]:
    ep, rep = tcp(), tcp()
    agent = IndexAgent(agent_config(etcd_endpoint, key_prefix, instance_id, ep, rep))
    await agent.start()
    closers.append(agent)
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep,
                                           encoding=encoding))  # type: ignore[arg-type]
    await pub.start()
    closers.append(pub)
    return agent, pub


async def test_agent_indexes_vllm_and_sglang_engines_into_etcd(
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout,
        closers: list, tmp_path) -> None:
    vllm, vpub = await start_pair(closers, etcd_endpoint, key_prefix, "vllm-0", "array")
    sgl, spub = await start_pair(closers, etcd_endpoint, key_prefix, "sgl-0", "map")

    # vLLM: one BlockStored per run of full blocks, continued from a parent, unsigned hashes.
    v = SimEngine(BS, "unsigned")
    await publish_all(vpub, [[v.vllm_store(PROMPT[:4 * BS])], [v.vllm_store(PROMPT, 4)]],
                      lambda: vllm.ingestor.stats.last_seq)
    # SGLang: one BlockStored per page chained by parent, signed hashes, a partial last page
    # (refused: its block size is not the index's), and a BlockRemoved per radix node.
    s = SimEngine(BS, "signed")
    diverged = PROMPT[:5 * BS] + [7] * (2 * BS) + [9] * 4
    pages = s.sglang_store(diverged)
    await publish_all(spub, [pages[:3], pages[3:], [s.remove(diverged, [6])]],
                      lambda: sgl.ingestor.stats.last_seq)

    assert sgl.ingestor.stats.rejected == {"block_size_mismatch": 1}
    assert not vllm.ingestor.stats.rejected and not vllm.subscriber.malformed
    assert await vllm.wait_synced(10) and await sgl.wait_synced(10)

    want_v = block_hashes(PROMPT, BS)
    want_s = block_hashes(diverged[:6 * BS], BS)
    mirror = BlockMirror(etcd, layout, MODEL)
    mirror.start()
    closers.append(mirror)
    assert await mirror.wait_ready(10)
    assert mirror.blocks("vllm-0") == set(want_v) and len(want_v) == 8
    assert mirror.blocks("sgl-0") == set(want_s) and len(want_s) == 6
    assert mirror.lookup(want_v) == {"vllm-0": 8, "sgl-0": 5}

    # The agent made each instance visible (no bootstrap server wrote a record).
    rec = await etcd.get(layout.instance("vllm-0"))
    assert rec is not None and rec.lease == vllm.session.lease_id
    doc = loads(rec.value)
    assert (doc["source"], doc["role"], doc["model"]) == ("kv-events", "prefill", MODEL)

    # Its counters are published under the lease.
    async def stats_published() -> bool:
        kv = await etcd.get(stats_key(layout, "sgl-0"))
        if kv is None:
            return False
        st = loads(kv.value)
        return (st["last_seq"] == spub.next_seq - 1 and st["blocks"] == 6
                and st["rejected"] == {"block_size_mismatch": 1})
    await eventually(stats_published, 5, "sgl-0's stats key")
    # Idle counters are not rewritten (the interval is 0.1 s): once the writer has settled (its
    # state and lag may still change for a moment on a loaded machine), a quiet 0.4 s window
    # (four intervals) must pass without a single publish or etcd write.
    async def a_quiet_window() -> bool:
        before = sgl.publisher.publishes
        rev = (await etcd.get(stats_key(layout, "sgl-0"))).mod_revision  # type: ignore[union-attr]
        await asyncio.sleep(0.4)  # the window in which nothing may be written: the thing tested
        after = (await etcd.get(stats_key(layout, "sgl-0"))).mod_revision  # type: ignore[union-attr]
        return sgl.publisher.publishes == before and after == rev

    await wait_until(a_quiet_window, timeout=10,
                     what="a 0.4 s window passes without a stats publish or etcd write")

    # The CLI, a separate process reading etcd, finds the same prefixes.
    tokens_file = tmp_path / "prompt.json"
    tokens_file.write_text(json.dumps(PROMPT))
    rc, out, err = await run_cli("index", "query", "--model", MODEL, "--tokens-file",
                                 str(tokens_file), "--json", "--etcd", etcd_endpoint,
                                 "--etcd-prefix", key_prefix)
    assert rc == 0, err
    assert json.loads(out) == {"prompt_blocks": 8, "instances": [
        {"instance_id": "vllm-0", "matched_blocks": 8, "matched_tokens": 128,
         "fraction": round(128 / len(PROMPT), 6)},
        {"instance_id": "sgl-0", "matched_blocks": 5, "matched_tokens": 80,
         "fraction": round(80 / len(PROMPT), 6)}]}

    # A clean stop revokes the lease: blocks, record and stats of that instance vanish at once.
    closers.remove(vllm)
    await vllm.close()
    await eventually(lambda: "vllm-0" not in mirror.instances(), 5, "vllm-0's blocks to vanish")
    assert await etcd.get(layout.instance("vllm-0")) is None
    assert await etcd.get(stats_key(layout, "vllm-0")) is None
    assert mirror.blocks("sgl-0") == set(want_s)


async def test_agent_leaves_another_owners_instance_record_alone(
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout,
        closers: list) -> None:
    # A bootstrap server already registered the instance under its own lease.
    other, _ = await etcd.grant(30)
    theirs = dumps({"instance_id": "p-1", "role": "prefill", "model": MODEL,
                    "bootstrap_port": 8998})
    await etcd.put(layout.instance("p-1"), theirs, other)
    agent = IndexAgent(agent_config(etcd_endpoint, key_prefix, "p-1", tcp(), None))
    await agent.start()
    closers.append(agent)
    await eventually(lambda: agent.record.owner == "other", 5, "the agent to see the record")
    rec = await etcd.get(layout.instance("p-1"))
    assert rec is not None and (rec.value, rec.lease) == (theirs, other)

    # The bootstrap server dies: the agent keeps the instance visible with its own record.
    await etcd.revoke(other)

    async def claimed() -> bool:
        kv = await etcd.get(layout.instance("p-1"))
        return kv is not None and kv.lease == agent.session.lease_id
    await eventually(claimed, 5, "the agent to write its own record")
    assert loads((await etcd.get(layout.instance("p-1"))).value)["source"] == "kv-events"  # type: ignore[union-attr]
    # Deleted behind its back (etcdctl del): written again.
    await etcd.delete(layout.instance("p-1"))
    await eventually(claimed, 5, "the agent to rewrite its deleted record")
    assert agent.record.claims == 2

    # The bootstrap server comes back and rewrites its record: the agent lets go without
    # deleting it, and its own stop leaves the record in place.
    other2, _ = await etcd.grant(30)
    await etcd.put(layout.instance("p-1"), theirs, other2)
    await eventually(lambda: agent.record.owner == "other", 5, "the agent to let go")
    closers.remove(agent)
    await agent.close()
    rec = await etcd.get(layout.instance("p-1"))
    assert rec is not None and (rec.value, rec.lease) == (theirs, other2)
    await etcd.revoke(other2)


async def test_agent_refuses_an_endpoint_it_cannot_bind(etcd_endpoint: str, key_prefix: str) -> None:
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PULL)
    taken.setsockopt(zmq.LINGER, 0)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        agent = IndexAgent(agent_config(etcd_endpoint, key_prefix, "p-2",
                                        f"tcp://127.0.0.1:{port}", None))
        with pytest.raises(AgentError, match="cannot bind KV-event endpoint"):
            await agent.start()
        await agent.close()
    finally:
        taken.close()
        ctx.term()


@pytest.mark.parametrize("kwargs, match", [
    ({"instance_id": "bad id"}, "instance id"),
    ({"model": ""}, "model name"),
    ({"role": "router"}, "role"),
    ({"block_size": 0}, "block size"),
    ({"lease_ttl": 1}, "lease TTL"),
    ({"stats_interval": 0}, "stats interval"),
    ({"etcd_prefix": "kvatlas/"}, "prefix"),
])
def test_agent_config_rejects_bad_settings(kwargs: dict, match: str) -> None:
    base = {"instance_id": "p-0", "model": "m"}
    with pytest.raises(ValueError, match=match):
        AgentConfig(**{**base, **kwargs})


def test_agent_config_filters_topics_by_model() -> None:
    cfg = AgentConfig(instance_id="p-0", model="m")
    assert cfg.events.model == "m" and cfg.block_size == 16 and cfg.role == "prefill"


