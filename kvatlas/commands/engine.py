"""``kvatlas engine serve``: run one engine worker: monolithic (with ``--etcd``: registered as an
``aggregated`` instance, ``engine.aggregated``), or one half of a prefill/decode pair
(``--mode prefill|decode``, one process per rank; a decode also serves whole a request sent with
``X-Kvatlas-Prefill: local`` with ``--local-prefill``: ``engine.pd.local``)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from engine.pd.config import PDConfig
    from engine.serve_config import EngineServerConfig
    from index.access import ClusterAccess

    parser = subparsers.add_parser("engine", help="reference engine workers")
    sub = parser.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="serve the engine's HTTP API",
                           description="Serve the reference engine (SGLang/OpenAI-compatible "
                                       "HTTP): monolithic (with --etcd: an aggregated instance "
                                       "of the cluster), or one half of a PD pair.")
    EngineServerConfig.add_cli_args(serve)
    PDConfig.add_cli_args(serve)
    ClusterAccess.add_cli_args(serve, index=True)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os

    from engine.serve_config import EngineServerConfig

    logging.basicConfig(level=os.environ.get("KVATLAS_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineServerConfig.from_cli_args(args)
    if engine.mode == "monolithic":
        from engine.aggregated import AggregatedConfig
        from engine.server import run

        run(engine, AggregatedConfig.from_cli_args(args, engine))
        return 0
    from engine.pd.config import PDConfig
    from engine.ranks.launch import serve
    from index.access import ClusterAccess

    cfg = PDConfig.from_cli_args(args, engine,
                                ClusterAccess.from_cli_args(args, optional=True))
    return serve(cfg)
