"""Flags shared by several commands (etcd address and key prefix)."""
from __future__ import annotations

import argparse
import asyncio
import os
import signal

from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout
from index.shards import IndexShards

ETCD_PASSWORD_ENV = "KVATLAS_ETCD_PASSWORD"
"""Where ``--etcd-password`` is read from when not given (with ``--etcd-user``)."""

DEFAULT_ETCD = "127.0.0.1:2379"


def add_etcd_args(parser: argparse.ArgumentParser, index: bool = False) -> None:
    """The etcd flags; ``index``: also ``--index-etcd`` (commands that write or read blocks)."""
    g = parser.add_argument_group("etcd")
    g.add_argument("--etcd", default=None, metavar="HOST:PORT[,HOST:PORT]",
                   help=f"etcd endpoints (default {DEFAULT_ETCD})")
    g.add_argument("--etcd-prefix", default=DEFAULT_PREFIX,
                   help=f"key prefix (default {DEFAULT_PREFIX})")
    g.add_argument("--etcd-timeout", type=float, default=5.0, help="seconds per etcd call")
    g.add_argument("--etcd-user", default=None, help="etcd user (with --etcd-password)")
    g.add_argument("--etcd-password", default=None,
                   help=f"etcd password (default: ${ETCD_PASSWORD_ENV}, which keeps it out of ps)")
    g.add_argument("--etcd-ca", default=None, help="CA certificate (PEM); turns TLS on")
    g.add_argument("--etcd-cert", default=None, help="client certificate (PEM) for mutual TLS")
    g.add_argument("--etcd-key", default=None, help="client key (PEM) for mutual TLS")
    if index:
        IndexShards.add_cli_args(g)


def etcd_password(args: argparse.Namespace) -> str | None:
    """``--etcd-password``, else (with ``--etcd-user``) ``$KVATLAS_ETCD_PASSWORD``."""
    if args.etcd_password is None and args.etcd_user is not None:
        return os.environ.get(ETCD_PASSWORD_ENV) or None
    return args.etcd_password


def etcd_settings(args: argparse.Namespace) -> EtcdSettings:
    return EtcdSettings.from_text(
        args.etcd or DEFAULT_ETCD, timeout=args.etcd_timeout, user=args.etcd_user,
        password=etcd_password(args), ca_cert=args.etcd_ca, cert=args.etcd_cert,
        key=args.etcd_key,
    )


def key_layout(args: argparse.Namespace) -> KeyLayout:
    return KeyLayout(prefix=args.etcd_prefix)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (call inside the running loop): what a serving
    command waits on before it closes what it started."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
