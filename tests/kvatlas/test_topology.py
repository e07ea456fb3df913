"""The topology: validation, loopback by default, and etcd TLS/auth passed to every client."""
from __future__ import annotations

import pytest

from kvatlas.launcher import topology
from kvatlas.launcher.topology import EtcdClientFlags, LocalNetwork, Topology


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_process_listens_on_loopback_by_default() -> None:
    services = Topology().services(LocalNetwork(data_root="/tmp/x"))
    assert [s.role for s in services] == ["etcd", "prefill", "prefill", "decode", "router"]
    for s in services:
        if s.role == "etcd":
            assert all("0.0.0.0" not in a for a in s.args)
            assert "--listen-client-urls=http://127.0.0.1:" in " ".join(s.args)
        else:
            assert _flag(s.args, "--host") == "127.0.0.1", s.name
    ports = [s.port for s in services] + [p for s in services for p in s.extra_ports.values()]
    assert len(ports) == len(set(ports)), "every port is distinct"


def test_etcd_tls_and_auth_reach_every_etcd_client() -> None:
    flags = EtcdClientFlags(prefix="/other", user="u", password="p", ca="/ca.pem",
                            cert="/c.pem", key="/k.pem")
    topo = Topology(external_etcd="10.0.0.1:2379,10.0.0.2:2379", etcd_client=flags)
    services = topo.services(LocalNetwork())
    assert not [s for s in services if s.role == "etcd"], "external etcd starts no member"
    for s in services:
        assert _flag(s.args, "--etcd") == "10.0.0.1:2379,10.0.0.2:2379"
        for flag, value in (("--etcd-prefix", "/other"), ("--etcd-user", "u"),
                            ("--etcd-password", "p"), ("--etcd-ca", "/ca.pem"),
                            ("--etcd-cert", "/c.pem"), ("--etcd-key", "/k.pem")):
            assert _flag(s.args, flag) == value, (s.name, flag)


def test_tokens_are_generated_and_passed() -> None:
    a, b = Topology(), Topology()
    assert a.auth_token and a.admin_token and a.auth_token != b.auth_token
    services = {s.name: s for s in a.services(LocalNetwork())}
    assert _flag(services["router"].args, "--admin-token") == a.admin_token


def test_parallel_sizes_reach_the_instances() -> None:
    topo = Topology(prefill=1, decode=2, prefill_tp=2, prefill_dp=2, decode_tp=4)
    services = {s.name: s for s in topo.services(LocalNetwork())}
    assert (_flag(services["prefill-0"].args, "--tp"), _flag(services["prefill-0"].args, "--dp")) \
        == ("2", "2")
    assert _flag(services["decode-1"].args, "--tp") == "4"


def test_index_shards_are_etcds_of_their_own_named_to_prefills_and_router() -> None:
    topo = Topology(index_shards=2)
    net = LocalNetwork(data_root="/tmp/x")
    services = {s.name: s for s in topo.services(net)}
    shards = topo.index_etcd_endpoints(net)
    assert len(shards) == 2 and [services[n].role for n in topo.index_etcd_names()] == [
        "etcd", "etcd"]
    # One member each: a cluster of its own, not a member of the main one.
    for n in topo.index_etcd_names():
        (initial,) = [a for a in services[n].args if a.startswith("--initial-cluster=")]
        assert initial.startswith(f"--initial-cluster={n}=http://") and "," not in initial
    for name in ("prefill-0", "prefill-1", "router"):
        args = services[name].args
        i = args.index("--index-etcd")
        assert args[i + 1:i + 3] == shards, name
    assert "--index-etcd" not in services["decode-0"].args
    assert set(topo.index_etcd_names()) <= set(services["prefill-0"].depends_on)
    assert "--index-etcd" not in " ".join(
        a for s in Topology().services(net) for a in s.args)


@pytest.mark.parametrize("kw", [{"prefill": 0}, {"decode": 65}, {"etcd_members": 2},
                                {"engine_mode": "x"}, {"lease_ttl": 1}, {"model": ""},
                                {"index_shards": -1}, {"index_shards": 17}])
def test_bad_topologies_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Topology(**kw)  # type: ignore[arg-type]


def test_aggregated_instances_register_in_etcd_alone_or_beside_pd() -> None:
    from kvatlas.launcher.topology import instance_counts

    net = LocalNetwork()
    alone = Topology(prefill=0, decode=0, aggregated=2)
    services = {s.name: s for s in alone.services(net)}
    assert set(services) == {"etcd0", "aggregated-0", "aggregated-1", "router"}
    for name in ("aggregated-0", "aggregated-1"):
        svc = services[name]
        assert svc.role == "aggregated"
        assert _flag(svc.args, "--mode") == "monolithic"
        assert _flag(svc.args, "--instance-id") == name
        assert _flag(svc.args, "--etcd") == alone.etcd_endpoints(net)
        assert "etcd0" in svc.depends_on
    router = services["router"]
    assert set(router.depends_on) == {"aggregated-0", "aggregated-1"}
    # the router finds them in etcd: nothing is listed statically
    assert "--prefill" not in router.args and "--decode" not in router.args
    beside = {s.name for s in Topology(aggregated=1).services(net)}
    assert {"prefill-0", "prefill-1", "decode-0", "aggregated-0"} <= beside
    # `--aggregated N` alone means no PD pairs; PD defaults otherwise
    assert instance_counts(None, None, 2) == (0, 0)
    assert instance_counts(None, None, 0) == (2, 1)
    assert instance_counts(1, None, 2) == (1, 1)


@pytest.mark.parametrize("kw", [{"prefill": 0, "decode": 0},
                                {"prefill": 0, "decode": 1, "aggregated": 1},
                                {"aggregated": 65}, {"aggregated": -1},
                                {"aggregated": 1, "engine_mode": "monolithic"}])
def test_bad_aggregated_topologies_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Topology(**kw)  # type: ignore[arg-type]


def test_a_local_network_never_hands_out_one_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel may return a probed port again before anyone bound it: scripted here.
    probes = iter([41000, 41000, 41000, 41001])
    monkeypatch.setattr(topology, "free_port", lambda host: next(probes))
    net = LocalNetwork()
    assert (net.port("prefill-1", "http"), net.port("router", "http")) == (41000, 41001)
    assert net.port("prefill-1", "http") == 41000  # kept once given


def test_every_port_of_a_local_cluster_is_distinct() -> None:
    net = LocalNetwork(data_root="/tmp/x")
    services = Topology(prefill=4, decode=2, aggregated=2, etcd_members=3).services(net)
    assert services
    ports = list(net.fixed.values())
    assert len(ports) == len(set(ports)) >= 15, net.fixed
