"""Secrets may come from the environment, so that no command line (`ps`) shows them; a flag
given explicitly still wins."""
from __future__ import annotations

import argparse

import pytest

from bootstrap.client import BootstrapClientConfig
from bootstrap.config import BootstrapConfig
from kvatlas.commands._common import add_etcd_args, etcd_settings
from router.config import RouterConfig


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
    settings = etcd_settings(parsed(add_etcd_args, ["--etcd-user", "kv"]))
    assert (settings.user, settings.password) == ("kv", "etcd-secret")
    # Without a user the variable is ignored, rather than failing "user and password together".
    settings = etcd_settings(parsed(add_etcd_args, []))
    assert (settings.user, settings.password) == (None, None)
