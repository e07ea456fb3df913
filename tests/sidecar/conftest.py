"""The sidecar'd cluster: two standalone prefills and a decode, a sidecar beside each, a router
that knows them only through etcd (shared by the module's tests that do not kill anything)."""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from sidecar_procs import Engine, Router, Spawned, sidecar


@dataclass
class SidecarCluster:
    etcd: str
    prefix: str
    prefills: list[Engine]
    decode: Engine
    sidecars: dict[str, Spawned]
    router: Router
    extra: list[Spawned] = field(default_factory=list)
    """More routers (``start_cluster(routers=N)``), each finding the workers through etcd."""

    def all(self) -> list[Spawned]:
        return [*self.prefills, self.decode, *self.sidecars.values(), self.router, *self.extra]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.output(3000)}" for p in self.all())


def start_cluster(etcd: str, prefills: int = 2, router_extra: tuple[str, ...] = (),
                  sidecar_extra: Callable[[Engine], tuple[str, ...]] = lambda e: (),
                  routers: int = 1) -> SidecarCluster:
    """Engines first (ready), then a sidecar beside each (``sidecar_extra(engine)``: flags
    added to its command line, the last of a repeated flag wins), then the router."""
    prefix = f"/kvatlas-test-{uuid.uuid4().hex[:12]}"
    started: list[Spawned] = []
    try:
        engines = [Engine("prefill", f"p{i}") for i in range(prefills)]
        started += engines
        decode = Engine("decode", "d0")
        started.append(decode)
        for e in [*engines, decode]:
            e.wait_ready()
        cars = {e.name: sidecar(e, etcd, prefix, *sidecar_extra(e))
                for e in [*engines, decode]}
        started += cars.values()
        all_routers = [Router(etcd, prefix, *router_extra) for _ in range(routers)]
        started += all_routers
        for r in all_routers:
            r.wait_http(f"{r.url}/readiness", 60)
        router = all_routers[0]
    except BaseException:
        for p in started:
            print(f"--- {p.name}\n{p.output(3000)}")
            p.stop()
        raise
    return SidecarCluster(etcd, prefix, engines, decode, cars, router, list(all_routers[1:]))


def stop_cluster(cluster: SidecarCluster) -> None:
    for p in cluster.all():
        p.stop()
    assert not [p.name for p in cluster.all() if p.alive()], "left running"


@pytest.fixture(scope="module")
def shared_cluster(etcd_endpoint: str) -> Iterator[SidecarCluster]:
    cluster = start_cluster(etcd_endpoint)
    yield cluster
    stop_cluster(cluster)


@pytest.fixture
def own_cluster(etcd_endpoint: str) -> Iterator[list[SidecarCluster]]:
    """Clusters a test starts (and may break); all stopped afterwards."""
    made: list[SidecarCluster] = []
    yield made
    for cluster in made:
        stop_cluster(cluster)
