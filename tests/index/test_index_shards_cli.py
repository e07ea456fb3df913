"""``--index-etcd`` end to end on two real etcd clusters: an index agent writes its record to the
main etcd and its blocks to its shard, and ``kvatlas index query|dump|stats`` read every shard;
bad values are one CLI error line."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from agent_helpers import publish_all, run_cli, tcp
from kv_sim import SimEngine
from test_index_cli import one_line_error

from index.agent import AgentConfig, IndexAgent
from index.etcd import EtcdClient, EtcdSettings
from index.events.publisher import KVEventPublisher, PublisherConfig
from index.events.subscriber import SubscriberConfig
from index.keys import KeyLayout
from index.shards import IndexShards
from kvatlas.cli import main as cli_main
from kvatlas.etcd_proc import EtcdCluster

pytestmark = pytest.mark.timeout(60)

BS = 16
MODEL = "shard-model"
PROMPT = list(range(500, 500 + 6 * BS))


def on_shard(shards: IndexShards, shard: int) -> str:
    return next(f"agent-{k}" for k in range(1000) if shards.place(f"agent-{k}") == shard)


@pytest.fixture
async def agent_on_shard_1(etcd: EtcdClient, etcd_endpoint: str, etcd_shard: EtcdCluster,
                           key_prefix: str) -> AsyncIterator[tuple[IndexAgent, IndexShards]]:
    main = EtcdSettings.from_text(etcd_endpoint, timeout=3.0)
    shards = IndexShards.from_texts([etcd_endpoint, etcd_shard.endpoints], main)
    ep, rep = tcp(), tcp()
    agent = IndexAgent(AgentConfig(
        instance_id=on_shard(shards, 1), model=MODEL,
        events=SubscriberConfig(endpoint=ep, replay_endpoint=rep),
        etcd=main, etcd_prefix=key_prefix, lease_ttl=5, stats_interval=0.1,
        record_check_interval=0.1, index_etcd=shards))
    await agent.start()
    pub = KVEventPublisher(PublisherConfig(endpoint=ep, replay_endpoint=rep))
    await pub.start()
    sim = SimEngine(BS, "unsigned")
    await publish_all(pub, [[sim.vllm_store(PROMPT)]], lambda: agent.ingestor.stats.last_seq)
    assert await agent.wait_synced(10)
    yield agent, shards
    await pub.close()
    await agent.close()


async def test_agent_writes_blocks_to_its_shard_and_the_cli_reads_every_shard(
        agent_on_shard_1: tuple[IndexAgent, IndexShards], etcd: EtcdClient,
        etcd_endpoint: str, etcd_shard: EtcdCluster, key_prefix: str,
        layout: KeyLayout) -> None:
    agent, shards = agent_on_shard_1
    iid = agent.config.instance_id
    assert agent.blocks.shard == 1 and agent.blocks.own
    lease = agent.stats()["block_lease"]
    assert lease["shard"] == 1 and lease["endpoint"] == etcd_shard.endpoints and lease["healthy"]
    assert lease["id"] != agent.session.lease_id
    # The record in the main etcd, the blocks (6 of them) on shard 1 only.
    assert await etcd.get(layout.instance(iid)) is not None
    _, main_blocks = await etcd.get_prefix(layout.blocks_prefix())
    assert main_blocks == []
    async with EtcdClient(shards.clusters[1]) as client:
        _, kvs = await client.get_prefix(layout.blocks_prefix(MODEL))
    assert {kv.lease for kv in kvs} == {agent.blocks.session.lease_id}

    both = ("--etcd", etcd_endpoint, "--etcd-prefix", key_prefix,
            "--index-etcd", etcd_endpoint, etcd_shard.endpoints)
    tokens = ",".join(map(str, PROMPT))
    rc, out, err = await run_cli("index", "query", "--model", MODEL, "--tokens", tokens,
                                 "--json", *both)
    assert rc == 0, err
    assert json.loads(out)["instances"][0] == {
        "instance_id": iid, "matched_blocks": 6, "matched_tokens": 96, "fraction": 1.0}
    # Without --index-etcd only the main etcd is read: nothing there.
    rc, out, err = await run_cli("index", "query", "--model", MODEL, "--tokens", tokens,
                                 "--json", "--etcd", etcd_endpoint, "--etcd-prefix", key_prefix)
    assert rc == 0 and json.loads(out)["instances"] == [], err

    rc, out, err = await run_cli("index", "dump", "--instance", iid, "--json", *both)
    assert rc == 0, err
    assert sum(len(s["blocks"]) for s in json.loads(out)) == 6

    rc, out, err = await run_cli("index", "stats", "--json", "--sample", "0", *both)
    assert rc == 0, err
    doc = json.loads(out)
    row = next(r for r in doc["instances"] if r["instance_id"] == iid)
    assert row["blocks"] == 6 and row["applied"] == 1
    assert [(s["endpoint"], s["instances"]) for s in doc["index_shards"]] == [
        (etcd_endpoint, 0), (etcd_shard.endpoints, 1)]


@pytest.mark.parametrize("command", [
    ["index", "query", "--model", "m", "--tokens", "1"],
    ["index", "dump", "--instance", "p0"],
    ["index", "stats"],
    ["index", "agent", "--instance-id", "p0", "--model", "m", "--kv-events", "tcp://127.0.0.1:9"],
    ["router", "serve"],
    ["sidecar", "--instance-id", "p0", "--role", "prefill", "--engine-url", "http://127.0.0.1:9",
     "--model", "m"],
])
@pytest.mark.parametrize("value, says", [
    ("127.0.0.1", "--index-etcd '127.0.0.1': etcd endpoint '127.0.0.1' is not HOST:PORT"),
    ("127.0.0.1:70000", "is not HOST:PORT"),
])
def test_a_bad_index_etcd_is_one_line(command: list[str], value: str, says: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main([*command, "--etcd", "127.0.0.1:9", "--index-etcd", value])
    assert says in one_line_error(rc, capsys.readouterr().err)


def test_router_index_etcd_without_etcd_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["router", "serve", "--index-etcd", "127.0.0.1:2379"])
    assert "--index-etcd needs --etcd" in one_line_error(rc, capsys.readouterr().err)
