"""``ClusterAccess``: the one config (and set of flags) every process reaches the cluster with."""
from __future__ import annotations

import argparse

import pytest

from index.access import DEFAULT_ETCD, DEFAULT_LEASE_TTL, ETCD_PASSWORD_ENV, ClusterAccess
from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout
from index.shards import IndexShards


def parse(argv: list[str], index: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ClusterAccess.add_cli_args(parser, index=index)
    return parser.parse_args(argv)


def test_defaults() -> None:
    access = ClusterAccess()
    assert (access.etcd, access.prefix, access.index_shards, access.lease_ttl) == (
        None, DEFAULT_PREFIX, IndexShards(), DEFAULT_LEASE_TTL)
    assert access.layout == KeyLayout()
    assert access.main_etcd == EtcdSettings()
    # No flags: the default etcd, or none at all for a command where etcd is optional.
    assert ClusterAccess.from_cli_args(parse([])) == ClusterAccess(
        etcd=EtcdSettings.from_text(DEFAULT_ETCD))
    assert ClusterAccess.from_cli_args(parse([], index=True), optional=True) == ClusterAccess()


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"prefix": "kvatlas/"}, "--etcd-prefix"),
    ({"lease_ttl": 1}, "--lease-ttl"),
    ({"lease_ttl": 3601}, "--lease-ttl"),
    ({"index_shards": IndexShards.from_texts(["h1:1"], EtcdSettings())}, "--index-etcd needs --etcd"),
])
def test_validation_names_the_flag(kwargs: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ClusterAccess(**kwargs)  # type: ignore[arg-type]


def test_cli_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ETCD_PASSWORD_ENV, raising=False)
    args = parse(["--etcd", "h1:1,h2:2", "--etcd-prefix", "/other", "--etcd-timeout", "2.5",
                  "--etcd-user", "kv", "--etcd-password", "pw", "--etcd-ca", "ca.pem",
                  "--etcd-cert", "c.pem", "--etcd-key", "k.pem",
                  "--index-etcd", "s1:1", "s2:2,s3:3"], index=True)
    access = ClusterAccess.from_cli_args(args, lease_ttl=7)
    main = EtcdSettings(endpoints=("h1:1", "h2:2"), timeout=2.5, user="kv", password="pw",
                        ca_cert="ca.pem", cert="c.pem", key="k.pem")
    assert access == ClusterAccess(
        etcd=main, prefix="/other", lease_ttl=7,
        index_shards=IndexShards.from_texts(["s1:1", "s2:2,s3:3"], main))
    # Each shard is reached with the main etcd's credentials and TLS files.
    assert [(c.endpoints, c.user, c.ca_cert) for c in access.index_shards.clusters] == [
        (("s1:1",), "kv", "ca.pem"), (("s2:2", "s3:3"), "kv", "ca.pem")]
    assert access.layout.prefix == "/other"


def test_a_bad_flag_fails_naming_it() -> None:
    with pytest.raises(ValueError, match="--etcd-prefix"):
        ClusterAccess.from_cli_args(parse(["--etcd-prefix", "/trailing/"]))
    with pytest.raises(ValueError, match="--index-etcd needs --etcd"):
        ClusterAccess.from_cli_args(parse(["--index-etcd", "h:1"], index=True), optional=True)


def test_password_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ETCD_PASSWORD_ENV, "from-env")
    etcd = ClusterAccess.from_cli_args(parse(["--etcd-user", "kv"])).main_etcd
    assert (etcd.user, etcd.password) == ("kv", "from-env")
    etcd = ClusterAccess.from_cli_args(parse(["--etcd-user", "kv", "--etcd-password", "flag"])).main_etcd
    assert etcd.password == "flag"  # a flag given explicitly still wins
    etcd = ClusterAccess.from_cli_args(parse([])).main_etcd
    assert (etcd.user, etcd.password) == (None, None)  # without a user the variable is ignored


@pytest.mark.parametrize("argv", [[], ["--etcd-prefix", "/p", "--lease-ttl", "5"]])
def test_service_configs_share_the_access(argv: list[str]) -> None:
    """Each service config exposes its etcd fields as one ClusterAccess, and its flags build it
    through ClusterAccess.from_cli_args."""
    from bootstrap.config import BootstrapConfig
    from index.agent import AgentConfig
    from sidecar.config import SidecarConfig

    base = {"bootstrap": ["--instance-id", "p0", "--model", "tiny"],
            "agent": ["--instance-id", "p0", "--model", "tiny"],
            "sidecar": ["--instance-id", "p0", "--model", "tiny", "--role", "decode",
                        "--engine-url", "http://127.0.0.1:1"]}
    for name, cls in (("bootstrap", BootstrapConfig), ("agent", AgentConfig),
                      ("sidecar", SidecarConfig)):
        parser = argparse.ArgumentParser()
        cls.add_cli_args(parser)
        ClusterAccess.add_cli_args(parser)
        args = parser.parse_args([*base[name], *argv])
        access = ClusterAccess.from_cli_args(args, lease_ttl=args.lease_ttl)
        cfg = cls.from_cli_args(args, access)  # type: ignore[attr-defined]
        assert cfg.access.prefix == cfg.etcd_prefix == access.prefix, name
        assert cfg.access.lease_ttl == cfg.lease_ttl == access.lease_ttl, name
        assert cfg.layout == access.layout, name
