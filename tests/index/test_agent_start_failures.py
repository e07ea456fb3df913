"""An index agent whose start fails at any step leaves nothing behind (real etcd, real ZMQ).

``IndexAgent.start`` starts, in order: its presence (the etcd client, the id claim, the lease
task), its block pipeline (the block writer, then the KV-event subscriber: a bound SUB socket),
the instance-record task and the stats task. A failure is injected at each step; afterwards no
task runs, the subscriber's port can be bound again, and etcd holds nothing of the instance.
"""
from __future__ import annotations

import asyncio

import pytest
import zmq
from agent_helpers import tcp
from start_checks import Injected, port_free, raising, tasks_left

from index.agent import AgentConfig, IndexAgent
from index.agent_stats import StatsPublisher
from index.etcd import EtcdClient, EtcdSettings
from index.events.subscriber import KVEventSubscriber, SubscriberConfig
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.writer import BlockWriter

pytestmark = pytest.mark.timeout(60)
IID = "agent-start"

# (what fails, the function replaced by one that raises)
STEPS = [
    ("subscriber", KVEventSubscriber, "start"),
    ("connect", EtcdClient, "connect"),
    ("claim", None, "index.presence.connect_and_claim"),
    ("lease", LeaseSession, "run"),
    ("writer", BlockWriter, "start"),
    ("record", None, "record"),
    ("stats", StatsPublisher, "run"),
]


@pytest.mark.parametrize("step, owner, name", STEPS, ids=[s[0] for s in STEPS])
async def test_a_failed_start_closes_what_it_opened(
        step: str, owner: type | None, name: str, monkeypatch: pytest.MonkeyPatch,
        etcd: EtcdClient, etcd_endpoint: str, key_prefix: str, layout: KeyLayout) -> None:
    endpoint = tcp()
    port = int(endpoint.rsplit(":", 1)[1])
    agent = IndexAgent(AgentConfig(
        instance_id=IID, model="org/m", events=SubscriberConfig(endpoint=endpoint),
        etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0), etcd_prefix=key_prefix,
        lease_ttl=5, stats_interval=0.1, record_check_interval=0.1))
    assert agent.config.events.binds, "the subscriber binds here, so its port tells"
    if owner is not None:
        monkeypatch.setattr(owner, name, raising(step))  # the test's own client is connected
    elif name == "record":
        # The record keeper's class may be renamed; its instance's run is the step.
        monkeypatch.setattr(agent.record, "run", raising(step))
    else:
        monkeypatch.setattr(name, raising(step))
    before = asyncio.all_tasks()
    with pytest.raises(Injected):
        await agent.start()
    monkeypatch.undo()
    assert await tasks_left(before) == []
    assert port_free(port), f"the subscriber still holds port {port}"
    # ZMQ too: a new SUB socket binds the same endpoint (a leaked one would hold it).
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        sock.close()
    finally:
        ctx.term()
    _, kvs = await etcd.get_prefix(key_prefix.encode() + b"/")
    assert kvs == [], "keys of a failed start left in etcd"
    lease = agent.session.lease_id
    assert lease is None or await etcd.lease_ttl(lease) == -1
    await agent.close()  # closing after a failed start is harmless
