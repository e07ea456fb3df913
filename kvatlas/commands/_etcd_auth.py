"""``kvatlas cluster etcd-auth``: provision etcd's users and roles and enable auth.

Compose's one-shot ``etcd-auth`` service runs it before any other kvatlas process starts
(``cluster up`` does the same in-process). The passwords come from the environment
(``KVATLAS_ETCD_<KIND>_PASSWORD``), never from the command line.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from index.etcd import parse_endpoints
from index.keys import KeyLayout
from kvatlas.cli import CLIError
from kvatlas.etcd_proc import EtcdBinaryNotFound
from kvatlas.launcher.etcd_auth import EtcdAuth, ProvisionError, provision
from kvatlas.launcher.state import ClusterState


def register(sub: Any) -> None:
    p = sub.add_parser("etcd-auth", help="provision etcd users and roles and enable auth "
                                          "(passwords from $KVATLAS_ETCD_<KIND>_PASSWORD)")
    p.add_argument("--etcd", required=True, metavar="HOST:PORT[,HOST:PORT]",
                   help="the main etcd cluster's endpoints")
    p.add_argument("--index-etcd", action="extend", nargs="+", default=[],
                   metavar="HOST:PORT[,HOST:PORT]", help="index shard etcds, provisioned alike")
    p.add_argument("--etcd-prefix", default=KeyLayout().prefix, help="key prefix of the roles")
    p.set_defaults(func=cmd_etcd_auth)


def cmd_etcd_auth(args: argparse.Namespace) -> int:
    try:
        auth = EtcdAuth.from_env()
        layout = KeyLayout(prefix=args.etcd_prefix)
        clusters = [",".join(parse_endpoints(e)) for e in [args.etcd, *args.index_etcd]]
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    for endpoints in clusters:
        try:
            done = provision(endpoints, auth, layout)
        except (ProvisionError, EtcdBinaryNotFound) as exc:
            raise CLIError(str(exc)) from None
        print(f"etcd {endpoints}: " + ("auth enabled" if done else "auth was already on"))
    return 0


def previous_etcd_auth(run_dir: Path) -> EtcdAuth | None:
    """The credentials a stopped cluster of ``run_dir`` provisioned, when its etcd data is
    still there (``cluster up`` reuses them: that etcd has auth on with those users)."""
    if not (run_dir / "etcd").is_dir():
        return None
    try:
        auth = ClusterState.load(run_dir).topology.get("etcd_auth")
        return EtcdAuth(**auth) if isinstance(auth, dict) else None
    except (FileNotFoundError, ValueError, TypeError):
        return None
