"""A real PD cluster per test (etcd, two prefills, a decode, the router) on loopback ports.

Short lease TTL and health interval so that faults show within seconds; everything the cluster
started is stopped after the test, whatever happened.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fault_helpers import HEALTH_INTERVAL, LEASE_TTL

from kvatlas.launcher.supervisor import LocalCluster
from kvatlas.launcher.topology import Topology


@pytest.fixture
def pd_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    started: list[LocalCluster] = []

    def make(**kw: object) -> LocalCluster:
        topo = Topology(**{"prefill": 2, "decode": 1, "lease_ttl": LEASE_TTL, "model": "tiny",
                           "health_interval": HEALTH_INTERVAL, **kw})  # type: ignore[arg-type]
        cluster = LocalCluster(topo, tmp_path / f"run{len(started)}")
        started.append(cluster)
        cluster.start(timeout=90)
        return cluster

    yield make
    for cluster in started:
        cluster.stop()
        assert not [p.name for p in cluster.state.processes if p.alive()], "left running"
