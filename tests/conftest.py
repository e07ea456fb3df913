"""Shared fixtures: a real etcd process (session-scoped), a unique key prefix per test, and a
3-member etcd cluster for fault tests. etcd missing is a failure, never a skip."""
from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout
from kvatlas.etcd_proc import EtcdBinaryNotFound, EtcdCluster


def _docker_etcd() -> tuple[object, str] | None:
    """An etcd container when KVATLAS_TEST_DOCKER=1 and a Docker engine answers; optional."""
    if os.environ.get("KVATLAS_TEST_DOCKER") != "1":
        return None
    try:
        from testcontainers.core.container import DockerContainer
    except ImportError:
        return None
    container = DockerContainer("quay.io/coreos/etcd:v3.5.17").with_command(
        "etcd --listen-client-urls=http://0.0.0.0:2379 --advertise-client-urls=http://127.0.0.1:2379"
    ).with_exposed_ports(2379)
    container.start()
    return container, f"127.0.0.1:{container.get_exposed_port(2379)}"


@pytest.fixture(scope="session")
def etcd_endpoint() -> Iterator[str]:
    """Client endpoint of one real etcd process shared by the whole session."""
    docker = _docker_etcd()
    if docker is not None:
        container, endpoint = docker
        yield endpoint
        container.stop()  # type: ignore[attr-defined]
        return
    try:
        cluster = EtcdCluster(1).start()
    except EtcdBinaryNotFound as exc:
        pytest.fail(f"etcd is required for the test suite: {exc}")
    yield cluster.endpoints
    cluster.stop()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests sharing one etcd never see each other's keys."""
    return f"/kvatlas-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def layout(key_prefix: str) -> KeyLayout:
    return KeyLayout(prefix=key_prefix)


@pytest.fixture
def etcd_settings(etcd_endpoint: str) -> EtcdSettings:
    return EtcdSettings.from_text(etcd_endpoint, timeout=3.0)


@pytest.fixture
async def etcd(etcd_settings: EtcdSettings, key_prefix: str) -> AsyncIterator[EtcdClient]:
    """A connected client; every key under this test's prefix is deleted afterwards."""
    client = EtcdClient(etcd_settings)
    await client.connect()
    yield client
    await client.delete(key_prefix.encode() + b"/", prefix=True)
    await client.close()


def _fresh_cluster(size: int) -> Iterator[EtcdCluster]:
    try:
        cluster = EtcdCluster(size).start()
    except EtcdBinaryNotFound as exc:
        pytest.fail(f"etcd is required for the test suite: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_cluster3() -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on free loopback ports, for fault tests that kill members."""
    yield from _fresh_cluster(3)


@pytest.fixture
def etcd_shard() -> Iterator[EtcdCluster]:
    """A second etcd cluster (one member, its own process) to spread a block index over, with
    the session's etcd as the first shard; a test may kill and restart it."""
    yield from _fresh_cluster(1)
