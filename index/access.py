"""How a process reaches the cluster: etcd endpoints, TLS and auth, key prefix, index shards and
the lease TTL, in one config (``ClusterAccess``) with one set of flags.

Every service config (router, PD engine, bootstrap server, sidecar, index agent) and every CLI
command that reads etcd builds its view of the cluster from this, so the flags' names, defaults,
environment fallbacks and checks live in one place.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout
from index.shards import IndexShards

DEFAULT_LEASE_TTL = 10
"""Seconds an instance's keys outlive its process (``--lease-ttl``) unless told otherwise."""
MIN_LEASE_TTL = 2
"""etcd's shortest useful lease: keepalives go out every TTL/3."""
MAX_LEASE_TTL = 3600
"""An hour: longer keeps a dead instance routable for longer than anyone means to."""

ETCD_PASSWORD_ENV = "KVATLAS_ETCD_PASSWORD"
"""Where ``--etcd-password`` is read from when not given (with ``--etcd-user``)."""

DEFAULT_ETCD = "127.0.0.1:2379"
"""The etcd a command reaches without ``--etcd``."""


def check_lease_ttl(ttl: int) -> int:
    """``ttl`` if it is a usable lease TTL, else a ValueError naming ``--lease-ttl``."""
    if not MIN_LEASE_TTL <= ttl <= MAX_LEASE_TTL:
        raise ValueError(f"lease TTL (--lease-ttl) must be within [{MIN_LEASE_TTL}, "
                         f"{MAX_LEASE_TTL}] s, got {ttl}")
    return ttl


def etcd_password(args: argparse.Namespace) -> str | None:
    """``--etcd-password``, else (with ``--etcd-user``) ``$KVATLAS_ETCD_PASSWORD``."""
    if args.etcd_password is None and args.etcd_user is not None:
        return os.environ.get(ETCD_PASSWORD_ENV) or None
    return args.etcd_password


@dataclass(frozen=True)
class ClusterAccess:
    """Where the cluster is and how to reach it; validated on construction."""

    etcd: EtcdSettings | None = None
    """The main etcd (instance records, ranks, rooms, predictions; the block index too unless
    ``index_shards`` names clusters of its own), with its timeout, credentials and TLS files.
    None: no cluster (a router with static workers, an engine or bootstrap server alone)."""
    prefix: str = DEFAULT_PREFIX
    """Key prefix every kvatlas key sits under (``--etcd-prefix``)."""
    index_shards: IndexShards = field(default_factory=IndexShards)
    """The etcd clusters the block index is spread over (``--index-etcd``); none: ``etcd``."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """Seconds the keys a process writes under its lease outlive it (``--lease-ttl``)."""

    def __post_init__(self) -> None:
        try:
            KeyLayout(prefix=self.prefix)
        except ValueError as exc:
            raise ValueError(f"--etcd-prefix: {exc}") from None
        if self.index_shards.sharded and self.etcd is None:
            raise ValueError("--index-etcd needs --etcd (workers are discovered and instance "
                             "records live there)")
        check_lease_ttl(self.lease_ttl)

    @property
    def layout(self) -> KeyLayout:
        """The keys under ``prefix``."""
        return KeyLayout(prefix=self.prefix)

    @property
    def main_etcd(self) -> EtcdSettings:
        """``etcd``, or the default one when none is set (what an agent or sidecar dials)."""
        return self.etcd if self.etcd is not None else EtcdSettings()

    # --- CLI ----------------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, index: bool = False) -> None:
        """The etcd flags; ``index``: also ``--index-etcd`` (commands that write or read
        blocks). The lease TTL flag is each service's own (its help says whose keys)."""
        g = parser.add_argument_group("etcd")
        g.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT]",
                       help=f"etcd endpoints (default {DEFAULT_ETCD})")
        g.add_argument("--etcd-prefix", default=DEFAULT_PREFIX,
                       help=f"key prefix (default {DEFAULT_PREFIX})")
        g.add_argument("--etcd-timeout", type=float, default=5.0, help="seconds per etcd call")
        g.add_argument("--etcd-user", default=None, help="etcd user (with --etcd-password)")
        g.add_argument("--etcd-password", default=None,
                       help=f"etcd password (default: ${ETCD_PASSWORD_ENV}, which keeps it out "
                            "of ps)")
        g.add_argument("--etcd-ca", default=None, help="CA certificate (PEM); turns TLS on")
        g.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for mutual TLS")
        g.add_argument("--etcd-key", default=None, help="client key (PEM) for mutual TLS")
        if index:
            IndexShards.add_cli_args(g)
        else:
            # Present either way, so that reading it needs no getattr; () rather than None
            # tells a command without the flag from one where it was not given
            # (kvatlas.commands._run_dir takes the local cluster's shards only for the latter).
            parser.set_defaults(index_etcd=())

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, optional: bool = False,
                      lease_ttl: int = DEFAULT_LEASE_TTL) -> ClusterAccess:
        """From the flags of ``add_cli_args``. ``optional``: without ``--etcd`` there is no
        cluster (``etcd`` None) rather than the default one. ``lease_ttl``: the service's own
        ``--lease-ttl``."""
        etcd = None
        if args.etcd or not optional:
            etcd = EtcdSettings.from_text(
                args.etcd or DEFAULT_ETCD, timeout=args.etcd_timeout, user=args.etcd_user,
                password=etcd_password(args), ca_cert=args.etcd_ca, cert=args.etcd_cert,
                key=args.etcd_key)
        shards = IndexShards.from_cli_args(args, etcd or EtcdSettings())
        return cls(etcd=etcd, prefix=args.etcd_prefix, index_shards=shards, lease_ttl=lease_ttl)
