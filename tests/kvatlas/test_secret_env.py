"""Secrets may come from the environment, so that no command line (`ps`) shows them; a flag
given explicitly still wins."""
from __future__ import annotations

import argparse

import pytest

from bootstrap.client import BootstrapClientConfig
from bootstrap.config import BootstrapConfig
from index.access import ClusterAccess
from kvatlas.launcher.topology import LocalNetwork, Topology, process_args
from router.config import RouterConfig
from transfer import TransferConfig


def parsed(add: object, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)  # type: ignore[operator]
    return parser.parse_args(argv)


def test_router_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVATLAS_ADMIN_TOKEN", "from-the-env")
    assert RouterConfig.from_cli_args(parsed(RouterConfig.add_cli_args, [])).admin_token \
        == "from-the-env"
    args = parsed(RouterConfig.add_cli_args, ["--admin-token", "from-the-flag"])
    assert RouterConfig.from_cli_args(args).admin_token == "from-the-flag"
    monkeypatch.setenv("KVATLAS_ADMIN_TOKEN", "short")
    with pytest.raises(ValueError, match="admin token must be at least 8"):
        RouterConfig.from_cli_args(parsed(RouterConfig.add_cli_args, []))
    monkeypatch.delenv("KVATLAS_ADMIN_TOKEN")
    assert RouterConfig.from_cli_args(parsed(RouterConfig.add_cli_args, [])).admin_token is None


def test_bootstrap_server_and_client_token(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--instance-id", "p0", "--model", "tiny"]
    monkeypatch.setenv("KVATLAS_AUTH_TOKEN", "bootstrap-secret")
    cfg = BootstrapConfig.from_cli_args(parsed(BootstrapConfig.add_cli_args, base))
    assert cfg.auth_token == "bootstrap-secret"
    client = BootstrapClientConfig.from_cli_args(parsed(BootstrapClientConfig.add_cli_args, []))
    assert client.auth_token == "bootstrap-secret"
    cfg = BootstrapConfig.from_cli_args(parsed(BootstrapConfig.add_cli_args,
                                               [*base, "--auth-token", "flag"]))
    assert cfg.auth_token == "flag"


def test_etcd_password_needs_a_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVATLAS_ETCD_PASSWORD", "etcd-secret")
    settings = ClusterAccess.from_cli_args(
        parsed(ClusterAccess.add_cli_args, ["--etcd-user", "kv"])).main_etcd
    assert (settings.user, settings.password) == ("kv", "etcd-secret")
    # Without a user the variable is ignored, rather than failing "user and password together".
    settings = ClusterAccess.from_cli_args(parsed(ClusterAccess.add_cli_args, [])).main_etcd
    assert (settings.user, settings.password) == (None, None)


def test_transfer_key_comes_from_the_environment_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVATLAS_TRANSFER_KEY reaches the engine's TransferConfig; no flag could carry it into ps."""
    parser = argparse.ArgumentParser()
    TransferConfig.add_cli_args(parser)
    assert not [a for a in parser._actions if "key" in a.dest]
    monkeypatch.setenv("KVATLAS_TRANSFER_KEY", "transfer-key-from-the-env")
    assert TransferConfig.from_cli_args(parser.parse_args([])).key == "transfer-key-from-the-env"
    monkeypatch.setenv("KVATLAS_TRANSFER_KEY", "short")
    with pytest.raises(ValueError, match="KVATLAS_TRANSFER_KEY.*at least 16 characters"):
        TransferConfig.from_cli_args(parser.parse_args([]))
    monkeypatch.delenv("KVATLAS_TRANSFER_KEY")
    assert TransferConfig.from_cli_args(parser.parse_args([])).key is None


def test_cluster_up_generates_the_transfer_key_into_the_environment() -> None:
    a, b = Topology(), Topology()
    assert a.transfer_key and a.transfer_key != b.transfer_key
    for svc in a.services(LocalNetwork()):
        argv, env = process_args(svc)
        assert a.transfer_key not in " ".join(argv), svc.name
        if svc.role in ("prefill", "decode"):
            assert env["KVATLAS_TRANSFER_KEY"] == a.transfer_key, svc.name
        else:
            assert "KVATLAS_TRANSFER_KEY" not in env, svc.name
    mono = Topology(engine_mode="monolithic")
    assert not any(s.env for s in mono.services(LocalNetwork()))
