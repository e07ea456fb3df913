"""``kvatlas doctor``: check a running cluster link by link; print the first broken one."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from kvatlas.cli import CLIError
from kvatlas.commands._run_dir import add_cluster_etcd_args, cluster_access
from kvatlas.commands.route import router_url


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor", help="walk the evidence chain of a cluster; print the first failing link",
        description="Checks, in order: etcd; instance registration; per prefill instance its "
                    "ranks (n of m), topology and rank resolution, transfer sockets and a probe "
                    "whose room must reach 'consumed' on a decode; the router's readiness, "
                    "pools and breakers; per prefill why the router could see no prefix there "
                    "(settings it ignores, events rejected by reason, no events from an "
                    "instance that served requests, blocks that never match its hashes); the "
                    "index mirror, and a probe through the router. Per vLLM instance (sidecar --engine "
                    "vllm): KV events arrive, prefix caching on, block size matches, blocks "
                    "in the base namespace (no LoRA adapters, no salted blocks). Per vLLM "
                    "PD model: a pair, modes agree, push identities, a canary per prefill.")
    add_cluster_etcd_args(p, index=True)
    p.add_argument("--router", default=None, metavar="URL",
                   help="router base URL (default: the run dir's, else no router checks)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds per HTTP call")
    p.add_argument("--json", action="store_true", help="print the links as JSON")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from kvatlas.commands._doctor_vllm import vllm_doctor_links
    from kvatlas.commands._doctor_vllm_pd import vllm_pd_links
    from kvatlas.launcher.doctor import Doctor, Link

    access = cluster_access(args)
    router = None
    if args.router:
        router = args.router.rstrip("/")
    else:
        try:
            router = router_url(args)
        except CLIError:
            router = None
    doctor = Doctor(access.main_etcd, access.layout, router, timeout=args.timeout,
                    index_etcd=access.index_shards)

    async def walk() -> list[Link]:
        links = await doctor.run()
        # The vLLM checks walk the records the chain read, whatever link it stopped at:
        # vLLM's own silent-zero-hit causes per vLLM instance, then its PD pairs
        # (kv_transfer_params: modes, push identities, a canary per prefill).
        records = doctor.instances
        checked = await vllm_doctor_links(access.main_etcd, access.layout, records,
                                          args.timeout)
        checked += await vllm_pd_links(records.values(), args.timeout)
        return links + [Link(name, ok, detail, "" if ok else hint)
                        for name, ok, detail, hint in checked]

    links = asyncio.run(walk())
    if args.json:
        print(json.dumps([vars(link) for link in links], indent=2))
    else:
        for link in links:
            mark = "ok  " if link.ok else "FAIL"
            print(f"[{mark}] {link.name}: {link.detail}")
            if not link.ok:
                print(f"       next: {link.hint}")
        if links and all(link.ok for link in links):
            print(f"all {len(links)} links hold" + ("" if router else
                                                     " (no router given: router not checked)"))
    sys.stdout.flush()
    return 0 if links and all(link.ok for link in links) else 1
