"""The etcd a command talks to: ``--etcd`` if given, else the local cluster's (``--run-dir``).

``kvatlas cluster up`` (issue #7) writes ``<run-dir>/cluster.json`` with its etcd address under the
key ``etcd``; commands run next to that cluster then need no ``--etcd``. Without the file the
default ``127.0.0.1:2379`` applies.
"""
from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from index.access import DEFAULT_ETCD, ClusterAccess
from index.etcd import EtcdClient, EtcdSettings, KeyValue
from kvatlas.cli import CLIError
from kvatlas.launcher.etcd_auth import user_name

DEFAULT_RUN_DIR = ".kvatlas/run"


def add_cluster_etcd_args(parser: argparse.ArgumentParser, timeout: float | None = None,
                          index: bool = False) -> None:
    """The etcd flags plus ``--run-dir``; ``timeout`` overrides the per-call default;
    ``index``: also ``--index-etcd``."""
    ClusterAccess.add_cli_args(parser, index)
    parser.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                        help="local cluster run directory: without --etcd, the etcd of "
                             f"<run-dir>/cluster.json is used when it exists (default "
                             f"{DEFAULT_RUN_DIR}), else {DEFAULT_ETCD}")
    if timeout is not None:
        parser.set_defaults(etcd_timeout=timeout)


def _cluster_doc(args: argparse.Namespace) -> dict[str, Any]:
    """``<run-dir>/cluster.json``, or {} when there is none."""
    path = Path(args.run_dir) / "cluster.json"
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {path}: {exc}; fix it or pass --etcd") from None
    return doc if isinstance(doc, dict) else {}


def _cluster_shards(args: argparse.Namespace) -> list[str] | None:
    shards = _cluster_doc(args).get("index_etcd")
    if not shards:
        return None
    if not isinstance(shards, list) or not all(isinstance(e, str) and e for e in shards):
        raise CLIError(f"{args.run_dir}/cluster.json: 'index_etcd' "
                       f"must be a list of 'HOST:PORT[,HOST:PORT]', got {shards!r}")
    return shards


def resolve_etcd(args: argparse.Namespace) -> str:
    """``--etcd`` if given, else ``etcd`` of ``<run-dir>/cluster.json`` if present, else default."""
    if args.etcd:
        return str(args.etcd)
    path = Path(args.run_dir) / "cluster.json"
    etcd = _cluster_doc(args).get("etcd")
    if etcd is None:
        return DEFAULT_ETCD
    if isinstance(etcd, list) and etcd and all(isinstance(e, str) for e in etcd):
        return ",".join(etcd)
    if not isinstance(etcd, str) or not etcd:
        raise CLIError(f"{path}: 'etcd' must be 'HOST:PORT[,HOST:PORT]', got {etcd!r}")
    return etcd


def _cluster_reader(args: argparse.Namespace) -> tuple[str, str] | None:
    """The local cluster's read-only etcd user and password (``cluster up`` generates them,
    ``kvatlas.launcher.etcd_auth``), or None when it runs without etcd auth."""
    auth = (_cluster_doc(args).get("topology") or {}).get("etcd_auth")
    if not auth:
        return None
    try:
        return user_name("reader"), str(auth["passwords"]["reader"])
    except (KeyError, TypeError):
        raise CLIError(f"{args.run_dir}/cluster.json has etcd auth "
                       "without a reader password; restart the cluster, or pass --etcd-user "
                       "(password in $KVATLAS_ETCD_PASSWORD)") from None


def cluster_access(args: argparse.Namespace) -> ClusterAccess:
    """The cluster the flags name, its main etcd found by ``resolve_etcd``. For a command
    taking ``--index-etcd`` given neither that nor ``--etcd``, the local cluster's index shards
    are taken too, and without ``--etcd-user`` its read-only credentials."""
    if not args.etcd:
        # None: the command has --index-etcd and it was not given (() where it has none).
        if args.index_etcd is None:
            args.index_etcd = _cluster_shards(args)
        reader = _cluster_reader(args) if args.etcd_user is None else None
        if reader is not None:
            args.etcd_user, args.etcd_password = reader
    args.etcd = resolve_etcd(args)
    return ClusterAccess.from_cli_args(args)


def index_shard_settings(args: argparse.Namespace) -> list[EtcdSettings]:
    """The etcds holding the block index: every ``--index-etcd`` cluster, else the main one."""
    access = cluster_access(args)
    return access.index_shards.shard_settings(access.main_etcd)


async def block_segments(args: argparse.Namespace, prefix: bytes) -> list[KeyValue]:
    """The keys under ``prefix`` (block segments) of every index shard, read at once."""
    async def one(settings: EtcdSettings) -> list[KeyValue]:
        async with EtcdClient(settings) as client:
            return (await client.get_prefix(prefix))[1]

    shards = await asyncio.gather(*(one(s) for s in index_shard_settings(args)))
    return [kv for kvs in shards for kv in kvs]
