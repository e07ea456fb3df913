"""The ``kvatlas`` command line: parse, then call. Failures are one clear line and exit 2."""
from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

from index.errors import IndexLayerError
from kvatlas import commands
from tokenization.base import TokenizationError


class CLIError(Exception):
    """A failure to report as one line (no traceback) with exit status 2."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; given a command line, only the invoked command's module is
    imported (the engine's pulls in torch: a second of start-up and ~200 MB that the router
    does not need)."""
    parser = argparse.ArgumentParser(
        prog="kvatlas",
        description="Control plane and KV data plane for PD-disaggregated LLM serving.",
    )
    parser.add_argument("--log-level", default="WARNING", type=_log_level,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging level (also accepted after the command, in any case)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    names = sorted(m.name for m in pkgutil.iter_modules(commands.__path__)
                   if not m.name.startswith("_"))
    wanted = _command_of(argv) if argv is not None else None
    for name in [wanted] if wanted in names else names:
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(sub)
    return parser


def _command_of(args: Sequence[str]) -> str | None:
    """The command word of ``args`` (None when there is none, e.g. ``--help``)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--log-level":
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg
    return None


def _log_level(text: str) -> str:
    """``--log-level`` as the logging module names it (sglang's lower-case ``warn`` too)."""
    level = text.upper()
    return "WARNING" if level == "WARN" else level


def _hoist_log_level(argv: list[str]) -> list[str]:
    """``argv`` with every ``--log-level`` moved before the command, where the parser takes it
    (the last one wins): a command line copied from sglang-router puts it after everything."""
    levels: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--log-level="):
            levels = [arg]
        elif arg == "--log-level" and i + 1 < len(argv):
            levels = [arg, argv[i + 1]]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return levels + rest


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The sub-parsers of ``parser`` by command word ({} when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """Exit 2 naming the first ``--flag`` no parser on the command's path knows, with the
    closest known one: argparse would first report the required flags it then finds missing
    (``--mesage`` reported as ``--message`` missing). Unique prefixes stay accepted."""
    known: set[str] = set()
    current = parser
    for arg in argv:
        if arg == "--":
            return
        known |= {f for f in current._option_string_actions if f.startswith("--")}
        sub = _subcommands(current).get(arg)
        if sub is not None:
            current = sub
            continue
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in known or any(k.startswith(flag) for k in known):
            continue
        close = difflib.get_close_matches(flag, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        current.error(f"unknown argument {flag}{hint}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = _hoist_log_level(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser(argv)
    check_flags(parser, argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (CLIError, IndexLayerError, TokenizationError, ValueError, OSError) as exc:
        print(f"kvatlas: error: {exc}", file=sys.stderr)
        return 2

