"""``kvatlas sidecar``: make a foreign engine instance (SGLang, vLLM) a kvatlas instance."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

from kvatlas.cli import CLIError
from kvatlas.commands._common import stop_on_signals
from kvatlas.commands._run_dir import add_cluster_etcd_args, cluster_access


def register(subparsers: Any) -> None:
    from sidecar.config import SidecarConfig

    p = subparsers.add_parser(
        "sidecar", help="run beside a foreign engine: its record, rank table and KV events in "
                        "etcd under one lease, and its health",
        description="Stands beside an SGLang (--engine sglang: prefill, decode or aggregated) or "
                    "a vLLM engine (--engine vllm: aggregated, or a NixlConnector prefill or "
                    "decode with --pd-protocol vllm-pull|vllm-push). Publishes the engine's "
                    "instance record (url, bootstrap address, model, "
                    "block size, tokenizer), mirrors a prefill's SGLang bootstrap rank table into "
                    "etcd, indexes its KV events (every attention-DP rank), and health-checks "
                    "it: unhealthy in the record within seconds, lease revoked after "
                    "--unhealthy-grace. Waits for an engine that is not up yet.")
    add_cluster_etcd_args(p, index=True)
    SidecarConfig.add_cli_args(p)
    p.set_defaults(func=cmd_sidecar)


def cmd_sidecar(args: argparse.Namespace) -> int:
    from sidecar.config import SidecarConfig
    from sidecar.errors import SidecarError

    config = SidecarConfig.from_cli_args(args, cluster_access(args))
    try:
        asyncio.run(_serve(config))
    except SidecarError as exc:
        raise CLIError(str(exc)) from None
    return 0


async def _serve(config: Any) -> None:
    """Run until SIGTERM/SIGINT, then revoke the lease so the instance's keys vanish at once."""
    from sidecar.service import Sidecar

    sidecar = Sidecar(config)
    await sidecar.start()
    stop = stop_on_signals()
    ev = config.events
    print(f"kvatlas sidecar: instance {config.instance_id} ({config.engine} {config.role}, "
          f"{config.model}): "
          f"engine {config.engine_url}"
          f"{f', bootstrap {config.bootstrap_url}' if config.bootstrap_url else ''}"
          f"{f', KV events {ev.endpoint} ({config.dp_size} rank(s))' if ev else ''}; etcd "
          f"{config.etcd.display} prefix {config.etcd_prefix}", flush=True)
    try:
        await sidecar.run(stop)
    finally:
        await sidecar.close()
    print(f"kvatlas sidecar: stopped after {sidecar.attachments} attachment(s); lease revoked",
          flush=True)
