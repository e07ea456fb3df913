"""``kvatlas bootstrap serve`` (the per-instance bootstrap server) and ``kvatlas bootstrap show``."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

from aiohttp import web

from bootstrap.config import BootstrapConfig
from bootstrap.http_limits import make_runner
from bootstrap.mirror import readable_ranks
from bootstrap.server import create_app
from index.access import ClusterAccess
from index.errors import RecordError
from index.etcd import EtcdClient
from index.record import InstanceRecord
from kvatlas.cli import CLIError
from kvatlas.commands._common import stop_on_signals
from kvatlas.commands._run_dir import add_cluster_etcd_args, cluster_access

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("bootstrap", help="the per-instance bootstrap server")
    sub = parser.add_subparsers(dest="bootstrap_command", metavar="SUBCOMMAND", required=True)

    serve = sub.add_parser("serve", help="run a bootstrap server (SGLang-compatible), mirrored to etcd")
    BootstrapConfig.add_cli_args(serve)
    ClusterAccess.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    show = sub.add_parser("show", help="an instance's rank table as mirrored in etcd")
    show.add_argument("instance_id", metavar="INSTANCE_ID")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_cluster_etcd_args(show)
    show.set_defaults(func=cmd_show)


# --- serve -----------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    config = BootstrapConfig.from_cli_args(args, ClusterAccess.from_cli_args(args))
    asyncio.run(serve(config))
    return 0


async def serve(config: BootstrapConfig) -> None:
    """Serve until SIGTERM/SIGINT, then shut down cleanly (the lease is revoked)."""
    runner = make_runner(create_app(config), access_log=None)
    try:
        # Inside the try: a start-up step that fails (the mirror's, the sweeper's) leaves the
        # steps before it to runner.cleanup(), which exits the contexts that did start.
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        try:
            await site.start()
        except OSError as exc:
            raise CLIError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}; "
                           "pick another --port") from None
        stop = stop_on_signals()
        mirror = f"mirrored to etcd {config.etcd.display}" if config.etcd else "no etcd mirror"
        print(f"kvatlas bootstrap: instance {config.instance_id} listening on "
              f"http://{config.host}:{config.port} ({mirror})", flush=True)
        await stop.wait()
        logger.info("shutting down")
    finally:
        await runner.cleanup()


# --- show ------------------------------------------------------------------------------------


async def _fetch_instance(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    access = cluster_access(args)
    layout, settings = access.layout, access.main_etcd
    async with EtcdClient(settings) as client:
        kv = await client.get(layout.instance(args.instance_id))
        if kv is None:
            raise CLIError(f"instance {args.instance_id!r} is not registered in etcd "
                           f"{settings.display} under {layout.prefix} "
                           "(`kvatlas instances` lists the live ones)")
        _, kvs = await client.get_prefix(layout.ranks_prefix(args.instance_id))
    ranks = [{**{k: v for k, v in r.items() if k != "key"},
              **dict(zip(("dp", "cp", "tp", "pp"), r["key"], strict=True))}
             for r in readable_ranks(layout, kvs)]
    ranks.sort(key=lambda r: (r["dp"], r["cp"], r["tp"], r["pp"]))
    try:
        record = InstanceRecord.from_json(kv.value, key=kv.key, instance_id=args.instance_id)
    except RecordError as exc:
        raise CLIError(f"{exc}; this kvatlas cannot show it") from None
    return record.to_dict(), ranks


def cmd_show(args: argparse.Namespace) -> int:
    instance, ranks = asyncio.run(_fetch_instance(args))
    if args.json:
        print(json.dumps({"instance": instance, "ranks": ranks}, indent=2))
        return 0
    from rich.table import Table

    from kvatlas.commands.instances import console, format_age

    expected = instance.get("expected_ranks")
    header = (f"{instance.get('instance_id')}  {instance.get('role', '?')}  {instance.get('model')}  "
              f"bootstrap {instance.get('bootstrap_host')}:{instance.get('bootstrap_port')}  "
              f"ranks {instance.get('registered_ranks')}/"
              f"{expected if expected is not None else '?'}  "
              f"{'ready' if instance.get('ready') else 'NOT ready'}  "
              f"age {format_age(time.time() - float(instance.get('started_at') or time.time()))}")
    out = console()
    out.print(header, soft_wrap=True, highlight=False)
    table = Table()
    for col in ("dp", "cp", "tp", "pp", "rank_ip", "rank_port"):
        table.add_column(col, justify="right" if col != "rank_ip" else "left")
    for r in ranks:
        table.add_row(str(r["dp"]), str(r["cp"]), str(r["tp"]), str(r["pp"]),
                      str(r.get("rank_ip")), str(r.get("rank_port")))
    out.print(table)
    topo = instance.get("topology")
    if topo:
        out.print("topology: " + ", ".join(f"{k}={v}" for k, v in topo.items()), soft_wrap=True,
                  highlight=False)
    sys.stdout.flush()
    return 0
