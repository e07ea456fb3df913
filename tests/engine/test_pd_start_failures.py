"""A prefill leader whose start fails at any step leaves nothing behind: every resource started
before the failing step is closed (no asyncio task left, no port left listening, every port it
had bound can be bound again), and no etcd lease or instance key of it outlives the refusal.

Each case makes one step of ``engine.pd.prefill.start_prefill`` raise (fault injection: the step's
function is replaced by one that raises; everything else is the real thing, with real etcd, real
ZMQ sockets and a real bootstrap server). The prefill is world rank 0 with etcd and two other DP
groups' KV-event endpoints, so that the index writer, the event feed and the subscribers are
started too."""
from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from aetcd import rpc
from aiohttp import web
from pd_helpers import pd_config

import engine.server as mono
from engine import registration
from engine.pd import prefill
from engine.pd.prefill_app import create_prefill_app
from engine.pd.state import RankContext
from engine.runner import AsyncEngine
from index import pipeline
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from kvatlas.etcd_proc import free_port

pytestmark = pytest.mark.timeout(60)


class Injected(RuntimeError):
    """The failure a test injects into one start step."""


def failing(real: Callable[..., Any], nth: int = 1) -> Callable[..., Any]:
    """``real``, except that its ``nth`` call raises ``Injected`` instead."""
    calls = 0

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == nth:
            raise Injected(f"injected failure in {getattr(real, '__name__', real)}")
        return real(*args, **kwargs)
    return call


# (step name, where the step's function lives, attribute, which call fails)
STEPS: list[tuple[str, Any, str, int]] = [
    ("group_leader", prefill, "start_group_leader", 1),
    ("sender", prefill, "create_sender", 1),
    ("bootstrap_server", prefill, "make_runner", 1),
    ("index_writer", pipeline, "BlockWriter", 1),
    ("event_feed", registration, "EventFeed", 1),  # engine.registration.open_local_feed
    # the other DP groups' subscribers are made by index.pipeline.BlockPipeline
    ("second_subscriber", pipeline, "KVEventSubscriber", 2),
    ("put_route", prefill, "put_route", 1),
    ("bootstrap_client", prefill, "BootstrapClient", 1),
    ("model_path", mono, "prepare_model_path", 1),
    ("engine_start", AsyncEngine, "start", 1),
]


def listening_ports() -> set[int]:
    """TCP ports this process has a listening socket on (from /proc: ZMQ's sockets too)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binds
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


async def lease_ids(endpoint: str) -> set[int]:
    """Every lease the etcd server holds (etcd's lease list)."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        resp = await rpc.LeaseStub(channel).LeaseLeases(rpc.LeaseLeasesRequest())
    return {lease.ID for lease in resp.leases}


async def settle(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``check`` holds within ``timeout`` (closed ZMQ sockets go away in ZMQ's thread)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


@pytest.mark.parametrize("step", [s[0] for s in STEPS] + ["none"])
async def test_failed_start_leaves_nothing(step: str, monkeypatch: pytest.MonkeyPatch,
                                           etcd_endpoint: str, key_prefix: str,
                                           etcd: EtcdClient, layout: KeyLayout) -> None:
    sub_ports = [free_port(), free_port()]
    cfg = pd_config("prefill", etcd=EtcdSettings.from_text(etcd_endpoint, timeout=3.0),
                    etcd_prefix=key_prefix, instance_id="pre-start", lease_ttl=30)
    ranks = RankContext(event_endpoints=[None, *(f"tcp://127.0.0.1:{p}" for p in sub_ports)],
                        replay_endpoints=[None, None, None])
    senders: list[Any] = []
    real_create_sender = prefill.create_sender

    def spy_create_sender(*args: Any, **kwargs: Any) -> Any:  # observes, does not replace
        sender = real_create_sender(*args, **kwargs)
        senders.append(sender)
        return sender
    monkeypatch.setattr(prefill, "create_sender", spy_create_sender)
    for name, owner, attr, nth in STEPS:
        if name == step:
            monkeypatch.setattr(owner, attr, failing(getattr(owner, attr), nth))

    me = asyncio.current_task()
    tasks_before = asyncio.all_tasks() - {me}
    ports_before = listening_ports()
    leases_before = await lease_ids(etcd_endpoint)
    runner = web.AppRunner(create_prefill_app(cfg, ranks))
    try:
        if step == "none":
            await runner.setup()
            # the mirror writes the record in its own task, after setup returns
            deadline = asyncio.get_running_loop().time() + 10.0
            while await etcd.get(layout.instance("pre-start")) is None:
                assert asyncio.get_running_loop().time() < deadline, "the record never appeared"
                await asyncio.sleep(0.05)
        else:
            with pytest.raises(Injected):
                await runner.setup()
    finally:
        await runner.cleanup()

    assert await settle(lambda: not (asyncio.all_tasks() - {me} - tasks_before)), \
        f"tasks left after a failed {step}: {asyncio.all_tasks() - {me} - tasks_before}"
    assert await settle(lambda: listening_ports() <= ports_before), \
        f"ports left listening after a failed {step}: {listening_ports() - ports_before}"
    bound = [cfg.bootstrap_port, *sub_ports, *(s.rank_address[1] for s in senders)]
    for port in bound:
        assert can_bind(port), f"port {port} cannot be bound again after a failed {step}"
    assert await lease_ids(etcd_endpoint) <= leases_before, f"a lease outlived a failed {step}"
    assert await etcd.get(layout.instance("pre-start")) is None
    _, left = await etcd.get_prefix(f"{key_prefix}/".encode())
    assert not left, f"keys left in etcd after a failed {step}: {[kv.key for kv in left]}"
