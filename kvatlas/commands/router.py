"""``kvatlas router serve``: the KV-aware PD router (flags mirror sglang-router's PD mode)."""
from __future__ import annotations

import argparse
from typing import Any

from index.access import ClusterAccess
from router.app import run
from router.config import RouterConfig


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("router", help="the KV-aware prefill/decode router")
    sub = parser.add_subparsers(dest="router_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve the router")
    RouterConfig.add_cli_args(serve)
    ClusterAccess.add_cli_args(serve, index=True)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    # Without --etcd the router serves its static workers only (sglang-router style).
    run(RouterConfig.from_cli_args(args, ClusterAccess.from_cli_args(args, optional=True)))
    return 0
