"""``kvatlas engine serve``: run one engine worker (monolithic now; prefill/decode with #5)."""
from __future__ import annotations

import argparse

from kvatlas.cli import CLIError


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from engine.serve_config import EngineServerConfig

    parser = subparsers.add_parser("engine", help="reference engine workers")
    sub = parser.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve the engine's HTTP API",
                           description="Serve the reference engine (SGLang/OpenAI-compatible HTTP).")
    EngineServerConfig.add_cli_args(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from engine.serve_config import MODES, EngineServerConfig
    from engine.server import run

    if args.mode not in MODES:
        raise CLIError(f"--mode {args.mode} is not implemented yet (available: {', '.join(MODES)})")
    run(EngineServerConfig.from_cli_args(args))
    return 0
