"""``kvatlas cluster up|status|down``: a whole PD cluster as local processes, one command.

``up`` starts embedded etcd (or uses ``--etcd HOST:PORT``), the prefill and decode instances and
the router on loopback, shows progress, waits for the router's /readiness and prints the
endpoints. The run directory (``--run-dir``, default ``.kvatlas/run``) records every process in
``cluster.json``; ``status`` and ``down`` (and ``index``, ``route``, ``generate``, ``doctor``)
find the cluster there. In the foreground, Ctrl-C stops everything; ``--detach`` returns and
leaves the cluster running until ``kvatlas cluster down``.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from index.access import DEFAULT_LEASE_TTL, ClusterAccess, etcd_password
from index.pd_protocol import CHOICES as PD_CHOICES
from kvatlas.cli import CLIError
from kvatlas.commands import _etcd_auth
from kvatlas.commands._run_dir import DEFAULT_RUN_DIR
from kvatlas.launcher.state import ClusterState, proc_rss
from kvatlas.launcher.supervisor import LocalCluster, StartError, http_status, stop_processes
from kvatlas.launcher.topology import (
    DEFAULT_MODEL,
    ENGINE_KINDS,
    EtcdClientFlags,
    Topology,
    instance_counts,
)

DEFAULT_ROUTER_PORT = 8000
"""The router's port when free: `kvatlas route`/`generate` find it there without --run-dir."""


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("cluster", help="a local PD cluster: up, status, down")
    sub = parser.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)

    up = sub.add_parser("up", help="start etcd, prefill and decode instances and the router")
    add_instance_args(up)
    up.add_argument("--prefill-tp", type=int, default=1, help="TP ranks per prefill instance")
    up.add_argument("--prefill-dp", type=int, default=1, help="DP ranks per prefill instance")
    up.add_argument("--decode-tp", type=int, default=1, help="TP ranks per decode instance")
    up.add_argument("--etcd-members", type=int, default=1, choices=(1, 3),
                    help="embedded etcd members (default 1)")
    up.add_argument("--index-shards", type=int, default=0,
                    help="embedded etcds to spread the block index over (--index-etcd of the "
                         "prefills and the router); default 0: the blocks live in the main etcd")
    up.add_argument("--model", default=DEFAULT_MODEL,
                    help=f"what the engines serve (default {DEFAULT_MODEL}, a real instruct "
                         "model; tiny: the seeded byte-tokenizer model tests use)")
    up.add_argument("--router-port", type=int, default=None,
                    help=f"router port (default {DEFAULT_ROUTER_PORT} when free, else a free one)")
    up.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                    help="instance lease TTL in seconds")
    up.add_argument("--engine-mode", default="pd", choices=("pd", "monolithic"),
                    help="pd (default): prefill/decode engines; monolithic: stand-ins")
    up.add_argument("--detach", action="store_true", help="return once ready; stop with down")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    ClusterAccess.add_cli_args(up)
    up.set_defaults(func=cmd_up)
    # --etcd: "embedded" (default) or an external HOST:PORT[,...]. The shared flag's help names
    # the client default (127.0.0.1:2379), which is wrong here: argparse has no public setter.
    next(a for a in up._actions if a.dest == "etcd").help = (
        "embedded (default: etcd started and locked by cluster up) or an external "
        "HOST:PORT[,HOST:PORT], which must already be provisioned")
    up.set_defaults(etcd=None)

    for name, func, text in (("status", cmd_status, "processes, health, readiness, index size"),
                             ("down", cmd_down, "stop every process of the cluster")):
        p = sub.add_parser(name, help=text)
        if name == "status":
            p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(func=func)
    compose = sub.add_parser("compose", help="print docker-compose.yml for the same topology")
    compose.add_argument("--engine", choices=ENGINE_KINDS, default="kvatlas",
                         help="kvatlas (default): kvatlas's own engines, as docker-compose.yml; "
                              "sglang: SGLang engines with a kvatlas sidecar each, as "
                              "deploy/sglang/docker-compose.yml")
    add_instance_args(compose)
    compose.set_defaults(func=cmd_compose)
    _etcd_auth.register(sub)
    for p in (up, *[sub.choices[n] for n in ("status", "down")]):
        p.add_argument("--run-dir", default=DEFAULT_RUN_DIR,
                       help=f"the cluster's state and logs (default {DEFAULT_RUN_DIR})")


def add_instance_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=None,
                        help="prefill instances (default 2, or 0 with --aggregated alone)")
    parser.add_argument("--decode", type=int, default=None,
                        help="decode instances (default 1, or 0 with --aggregated alone)")
    parser.add_argument("--aggregated", type=int, default=0,
                        help="aggregated instances: monolithic engines registered in etcd that "
                             "the router sends whole requests (default 0)")
    parser.add_argument("--pd-protocol", default="sglang", choices=PD_CHOICES,
                        help="the PD protocol the prefill and decode engines serve and the "
                             "router drives: sglang (default: SGLang's bootstrap), vllm or "
                             "vllm-pull (vLLM's kv_transfer_params, pull), vllm-push")


def topology_from_args(args: argparse.Namespace) -> Topology:
    external = None if args.etcd in (None, "embedded") else args.etcd
    reused = None if external else _etcd_auth.previous_etcd_auth(Path(args.run_dir))
    client = EtcdClientFlags(prefix=args.etcd_prefix, user=args.etcd_user,
                             password=etcd_password(args), ca=args.etcd_ca, cert=args.etcd_cert,
                             key=args.etcd_key)
    prefill, decode = instance_counts(args.prefill, args.decode, args.aggregated)
    return Topology(prefill=prefill, decode=decode, aggregated=args.aggregated,
                    prefill_tp=args.prefill_tp,
                    prefill_dp=args.prefill_dp, decode_tp=args.decode_tp, model=args.model,
                    etcd_members=args.etcd_members, external_etcd=external,
                    etcd_client=client, lease_ttl=args.lease_ttl, engine_mode=args.engine_mode,
                    index_shards=args.index_shards, etcd_auth=reused,
                    pd_protocol=args.pd_protocol)


def _refuse_running(run_dir: Path) -> None:
    try:
        state = ClusterState.load(run_dir)
    except (FileNotFoundError, ValueError):
        return
    live = [p.name for p in state.processes if p.alive()]
    if live:
        raise CLIError(f"a cluster is already running from {run_dir} ({', '.join(live)}); "
                       f"`kvatlas cluster down --run-dir {run_dir}` first")


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops a foreground cluster the way Ctrl-C does."""
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    from rich.console import Console

    run_dir = Path(args.run_dir)
    _refuse_running(run_dir)
    topology = topology_from_args(args)
    router_default_busy = not args.router_port and not _port_free(DEFAULT_ROUTER_PORT)
    router_port = args.router_port or (None if router_default_busy else DEFAULT_ROUTER_PORT)
    ports = {("router", "router"): router_port} if router_port else None
    cluster = LocalCluster(topology, run_dir, ports=ports)
    console = Console(stderr=True)
    started = time.monotonic()
    stop_requested = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        stop_requested.set()

    signal.signal(signal.SIGTERM, _interrupt)
    detached = False
    try:
        try:
            with console.status("starting the cluster ...") as status:
                def progress(name: str, event: str) -> None:
                    if event == "ready":
                        console.print(f"  [green]✓[/] {name} ready "
                                      f"({time.monotonic() - started:.1f}s)", highlight=False)
                    else:
                        status.update(f"starting {name} ...")
                cluster.start(timeout=args.timeout, progress=progress)
        except StartError as exc:
            raise CLIError(f"cluster did not start: {exc}") from None
        if args.detach:
            print_endpoints(cluster.state, time.monotonic() - started, router_default_busy)
            cluster.state.supervisor_pid = None
            cluster.state.save()
            detached = True
            print(f"detached; stop with: kvatlas cluster down --run-dir {args.run_dir}")
            return 0
        # From here a signal only asks for the stop, which then runs on the normal path: an
        # exception raised between two statements could otherwise skip it.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, request_stop)
        print_endpoints(cluster.state, time.monotonic() - started, router_default_busy)
        print("running in the foreground; Ctrl-C stops everything", flush=True)
        _watch(cluster.state, stop_requested)
        print("\nstopping the cluster ...", flush=True)
    except KeyboardInterrupt:
        console.print("interrupted: stopping what started")
        return 130
    finally:
        if not detached:
            # A second Ctrl-C must not cut the stop short: the processes run in their own
            # sessions and would be left behind.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, request_stop)
            cluster.stop()
    print("stopped; nothing left running")
    return 0


def _watch(state: ClusterState, stop_requested: threading.Event) -> None:
    """Report each process that exits, until a stop is asked for or every process is gone."""
    reported: set[tuple[str, int]] = set()
    while not stop_requested.wait(1.0):
        for p in state.processes:
            if (p.name, p.pid) not in reported and not p.alive():
                reported.add((p.name, p.pid))
                print(f"warning: {p.name} exited; see {p.log}", file=sys.stderr, flush=True)
        if len(reported) >= len(state.processes):
            print("every process has exited (`kvatlas cluster down`?)", flush=True)
            return


def busy_port_note(state: ClusterState, router_default_busy: bool) -> str | None:
    """The line saying where the router went when its default port was taken: a client aimed at
    127.0.0.1:8000 would reach whatever holds it, so say how this cluster is found instead."""
    if not router_default_busy:
        return None
    run_dir = state.run_dir
    hint = "" if Path(run_dir) == Path(DEFAULT_RUN_DIR) else f" --run-dir {run_dir}"
    return (f"port {DEFAULT_ROUTER_PORT} was busy: the router took {state.router['url']}; "
            f"kvatlas generate/route{hint} find it through {run_dir}/cluster.json, other clients "
            "need that URL")


def print_endpoints(state: ClusterState, elapsed: float, router_default_busy: bool = False
                    ) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvatlas cluster ready in {elapsed:.1f}s (run dir {state.run_dir})")
    for col in ("process", "role", "pid", "endpoint"):
        table.add_column(col)
    for p in state.processes:
        extra = "".join(f"  {k} :{v}" for k, v in p.ports.items() if k not in ("http",))
        table.add_row(p.name, p.role, str(p.pid), p.url + extra)
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    print(f"router: {state.router['url']}   etcd: {state.etcd}"
          + (f"   index shards: {' '.join(state.index_etcd)}" if state.index_etcd else ""),
          flush=True)
    note = busy_port_note(state, router_default_busy)
    if note:
        print(note, flush=True)


def _json(url: str) -> tuple[int, Any]:
    status, body = http_status(url, timeout=2.0)
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


def collect_status(state: ClusterState) -> dict[str, Any]:
    """Processes (alive, health, rss), router readiness and workers, and the index size."""
    from kvatlas.launcher.supervisor import healthy
    procs = []
    for p in state.processes:
        alive = p.alive()
        procs.append({"name": p.name, "role": p.role, "pid": p.pid, "alive": alive,
                      "healthy": alive and healthy(p.role, p.health_url.replace(
                          "/readiness", "/health")),
                      "rss_mb": round((proc_rss(p.pid) or 0) / 2 ** 20, 1) if alive else None,
                      "url": p.url, "log": p.log})
    router = state.router["url"]
    ready_status, readiness = _json(f"{router}/readiness")
    _, workers = _json(f"{router}/workers")
    return {"run_dir": state.run_dir, "etcd": state.etcd, "router": router,
            "processes": procs, "ready": ready_status == 200, "readiness": readiness,
            "workers": workers}


def cmd_status(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    try:
        state = ClusterState.load(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    st = collect_status(state)
    if args.json:
        print(json.dumps(st, indent=2))
        return 0 if st["ready"] else 1
    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title=f"processes ({state.run_dir})")
    for col in ("process", "role", "pid", "state", "health", "rss MB", "endpoint"):
        table.add_column(col)
    for p in st["processes"]:
        table.add_row(p["name"], p["role"], str(p["pid"]),
                      "[green]running[/]" if p["alive"] else "[red]exited[/]",
                      "ok" if p["healthy"] else "[red]failing[/]",
                      str(p["rss_mb"] or "-"), p["url"])
    console.print(table)
    workers = st["workers"] or {}
    wt = Table(title="instances seen by the router")
    for col in ("instance", "role", "ready", "healthy", "circuit", "load", "requests"):
        wt.add_column(col)
    for role in ("prefill", "decode", "aggregated"):
        for w in workers.get(role, []):
            wt.add_row(w["instance_id"], role, str(w["ready"]), str(w["healthy"]),
                       w["circuit"], str(w["load"]), str(w["requests"]))
    console.print(wt)
    index = (st["readiness"] or {}).get("index", {})
    console.print(f"router {st['router']}: {'[green]ready[/]' if st['ready'] else '[red]NOT ready[/]'}"
                  f"   index: {index.get('state', '?')}, {index.get('blocks', '?')} blocks, "
                  f"revision {index.get('revision', '?')}   etcd: {st['etcd']}", highlight=False)
    return 0 if st["ready"] else 1


def cmd_down(args: argparse.Namespace) -> int:
    try:
        state = ClusterState.load(args.run_dir)
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    stopped = stop_processes(state)
    left = [p.name for p in state.processes if p.alive()]
    if left:
        raise CLIError(f"still running after SIGKILL: {', '.join(left)}")
    print(f"stopped {len(stopped)} processes ({', '.join(stopped) or 'none were running'}); "
          "nothing left running")
    return 0


def cmd_compose(args: argparse.Namespace) -> int:
    if args.engine == "sglang":
        if (args.aggregated or args.prefill is not None or args.decode is not None
                or args.pd_protocol != "sglang"):
            raise CLIError("--prefill, --decode, --aggregated and --pd-protocol shape --engine kvatlas's "
                           "compose file; the SGLang one has a fixed shape")
        from kvatlas.launcher.compose_sglang import sglang_compose_yaml
        sys.stdout.write(sglang_compose_yaml())
        return 0
    from kvatlas.launcher.compose import compose_topology, compose_yaml
    prefill, decode = instance_counts(args.prefill, args.decode, args.aggregated)
    sys.stdout.write(compose_yaml(compose_topology(prefill, decode, args.aggregated,
                                                   pd_protocol=args.pd_protocol)))
    return 0
