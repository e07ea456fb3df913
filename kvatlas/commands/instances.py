"""``kvatlas instances``: every instance registered in etcd, one row each."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from index.errors import MalformedKey, RecordError
from index.etcd import EtcdClient
from index.record import InstanceRecord
from kvatlas.commands._run_dir import add_cluster_etcd_args, cluster_access


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("instances", help="list the instances registered in etcd")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_cluster_etcd_args(parser)
    parser.set_defaults(func=cmd_instances)


def console() -> Console:
    # Piped output (scripts, tests) should not be cut at 80 columns.
    return Console(width=None if sys.stdout.isatty() else 200)


def format_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


async def fetch_instances(args: argparse.Namespace) -> list[dict[str, Any]]:
    access = cluster_access(args)
    layout = access.layout
    async with EtcdClient(access.main_etcd) as client:
        _, kvs = await client.get_prefix(layout.instances_prefix())
    out: list[dict[str, Any]] = []
    for kv in kvs:
        try:
            iid = layout.parse_instance(kv.key)
        except MalformedKey as exc:
            # Listed under the key as etcd holds it: an operator sees what nothing reads.
            out.append({"instance_id": exc.key, "refused": exc.reason, "error": exc.detail})
            continue
        try:
            value = InstanceRecord.from_json(kv.value, key=kv.key, instance_id=iid).to_dict()
        except RecordError as exc:
            # Still listed, so an operator sees the key exists and why nothing uses it.
            value = {"instance_id": iid, "refused": exc.reason, "error": exc.detail}
        out.append(value)
    out.sort(key=lambda v: str(v["instance_id"]))
    return out


def cmd_instances(args: argparse.Namespace) -> int:
    instances = asyncio.run(fetch_instances(args))
    now = time.time()
    if args.json:
        for inst in instances:
            started = inst.get("started_at")
            inst["age_s"] = round(now - started, 3) if isinstance(started, (int, float)) else None
        print(json.dumps(instances, indent=2))
        return 0
    table = Table(title=f"{len(instances)} instance(s)", title_justify="left")
    for col, justify in (("id", "left"), ("role", "left"), ("model", "left"),
                         ("bootstrap", "left"), ("ranks", "right"), ("ready", "left"),
                         ("age", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for inst in instances:
        host, port = inst.get("bootstrap_host"), inst.get("bootstrap_port")
        expected = inst.get("expected_ranks")
        started = inst.get("started_at")
        table.add_row(
            str(inst["instance_id"]), str(inst.get("role", "?")), str(inst.get("model", "?")),
            f"{host}:{port}" if host and port else "-",
            f"{inst.get('registered_ranks') or 0}/{expected if expected is not None else '?'}",
            "yes" if inst.get("ready") else "no",
            format_age(now - started) if isinstance(started, (int, float)) else "?",
        )
    console().print(table)
    return 0
