"""``kvatlas router serve``: the KV-aware PD router (flags mirror sglang-router's PD mode)."""
from __future__ import annotations

import argparse
from typing import Any

from kvatlas.commands._common import add_etcd_args, etcd_settings
from router.app import run
from router.config import RouterConfig


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("router", help="the KV-aware prefill/decode router")
    sub = parser.add_subparsers(dest="router_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve the router")
    RouterConfig.add_cli_args(serve)
    add_etcd_args(serve, index=True)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    # Without --etcd the router serves its static workers only (sglang-router style).
    etcd = etcd_settings(args) if args.etcd else None
    run(RouterConfig.from_cli_args(args, etcd=etcd))
    return 0
