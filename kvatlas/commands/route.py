"""``kvatlas route --prompt TEXT | --chat FILE | --message ROLE=TEXT...``: the router's decision for a
prompt, without sending it.

The router tokenizes the prompt with its model's tokenizer, as it does for a real request; with
``--tokenizer`` the command encodes it here instead (``kvatlas.commands._prompt``) and sends the
ids, to see what another tokenizer's ids would match.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.table import Table

from kvatlas.commands._prompt import add_prompt_args, chat_messages, encode, load
from kvatlas.commands._run_dir import DEFAULT_RUN_DIR

DEFAULT_ROUTER = "http://127.0.0.1:8000"
STATE_FILES = ("cluster.json", "state.json")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default=None, metavar="URL",
                        help=f"router base URL (default: the router of --run-dir's cluster, "
                             f"else {DEFAULT_ROUTER})")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help="a local cluster's run directory (kvatlas cluster up); its state "
                             f"file names the router (default {DEFAULT_RUN_DIR}, when it has one)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait")


def router_url(args: argparse.Namespace) -> str:
    """--router, else the router URL recorded in --run-dir's state file (by default
    ``.kvatlas/run``'s: a cluster that took another port than 8000 is still the one reached),
    else the default URL when no --run-dir was given."""
    from kvatlas.cli import CLIError
    if args.router:
        return args.router.rstrip("/")
    run_dir = Path(args.run_dir or DEFAULT_RUN_DIR)
    if args.run_dir is None and not any((run_dir / n).exists() for n in STATE_FILES):
        return DEFAULT_ROUTER
    for name in STATE_FILES:
        path = run_dir / name
        if not path.exists():
            continue
        try:
            state = json.loads(path.read_text())
        except ValueError as exc:
            raise CLIError(f"{path} is not JSON: {exc}") from None
        url = _find_url(state)
        if url:
            return url.rstrip("/")
        raise CLIError(f"{path} names no router URL (expected router.url or router_url)")
    raise CLIError(f"no cluster state in {args.run_dir} (looked for {', '.join(STATE_FILES)}); "
                   "is the cluster up?")


def unreachable(url: str, exc: BaseException, timeout: float) -> Exception:
    """The one-line CLIError for a router that did not answer: its address and why, without
    aiohttp's connection-key repr."""
    from kvatlas.cli import CLIError
    if isinstance(exc, aiohttp.ClientConnectorError):
        why = exc.os_error.strerror or type(exc.os_error).__name__
    elif isinstance(exc, TimeoutError):
        why = f"no answer within {timeout:g} s (--timeout)"
    else:
        why = str(exc) or type(exc).__name__
    return CLIError(f"router at {url} is not answering: {why}; is the cluster up (kvatlas "
                    "cluster status), or pass --router/--run-dir")


def error_message(doc: Any) -> Any:
    """The message of an error answer: ``error`` as a string (SGLang routes) or OpenAI's
    ``{"error": {"message", ...}}`` object; the document itself when it is neither."""
    err = doc.get("error", doc) if isinstance(doc, dict) else doc
    return err.get("message", err) if isinstance(err, dict) else err


def _find_url(state: object) -> str | None:
    if not isinstance(state, dict):
        return None
    router = state.get("router")
    if isinstance(router, dict) and isinstance(router.get("url"), str):
        return router["url"]
    if isinstance(router, str):
        return router
    url = state.get("router_url")
    return url if isinstance(url, str) else None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("route", help="show which prefill/decode the router would pick")
    add_prompt_args(parser, tokenizer_help=SEND_IDS_HELP)
    parser.add_argument("--model", default=None, help="model name (hash namespace)")
    parser.add_argument("--json", action="store_true", help="print the raw JSON decision")
    add_router_args(parser)
    parser.set_defaults(func=cmd_route)


SEND_IDS_HELP = ("encode the prompt here with this tokenizer (a directory, a .gguf file, an alias "
                 "such as smollm2-135m, or 'byte') and send its token ids (default: send the "
                 "text or messages; the router tokenizes them with its model's tokenizer)")


def prompt_body(args: argparse.Namespace) -> dict[str, Any]:
    """The prompt part of a request body: ``text``, ``messages``, or, with ``--tokenizer``,
    the ``input_ids`` that tokenizer gives (CLIError for a bad prompt or tokenizer)."""
    messages = chat_messages(args)
    if args.tokenizer:
        return {"input_ids": encode(load(args.tokenizer), args, messages)}
    return {"messages": messages} if messages is not None else {"text": args.prompt}


async def fetch_decision(url: str, body: dict[str, Any], model: str | None,
                         timeout: float) -> tuple[int, dict[str, Any]]:
    body = dict(body)
    if model:
        body["model"] = model
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(f"{url}/debug/route", json=body) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, {"error": (await resp.text())[:200]}


OPTIONAL_COLUMNS = (("index_blocks", "index blocks"), ("predicted_blocks", "predicted blocks"))
"""Per-candidate figures a router may add (blocks the etcd index holds, blocks it predicts the
instance holds from what it routed there); shown when present."""


def render(decision: dict[str, Any], console: Console) -> None:
    aggregated = "worker" in decision  # one worker serves it whole (no PD pair)
    if aggregated:
        p = decision["worker"]
        console.print(f"aggregated worker [bold]{p['instance_id']}[/] {p['url']}")
    else:
        p, d = decision["prefill"], decision["decode"]
        console.print(f"prefill [bold]{p['instance_id']}[/] {p['url']} (bootstrap "
                      f"{p.get('bootstrap_host')}:{p.get('bootstrap_port') or 'default'})   "
                      f"decode [bold]{d['instance_id']}[/] {d['url']}")
    policy = decision.get("policy", {}).get("worker" if aggregated else "prefill")
    console.print(f"prompt {decision.get('prompt_tokens')} tokens = "
                  f"{decision.get('prompt_blocks')} blocks of {decision.get('block_size')}; "
                  f"policy {policy}; index {decision.get('index', {}).get('state')}")
    candidates = decision.get("candidates", [])
    extra = [(k, title) for k, title in OPTIONAL_COLUMNS
             if any(isinstance(c, dict) and k in c for c in candidates)]
    table = Table(title=f"{'worker' if aggregated else 'prefill'} candidates (lowest cost wins)")
    for col in ("instance", "matched blocks", *(t for _, t in extra), "load", "cost", ""):
        table.add_column(col, justify="left" if col == "instance" else "right")
    for c in candidates:
        chosen = "← chosen" if c["instance_id"] == p["instance_id"] else ""
        table.add_row(c["instance_id"], str(c["matched_blocks"]),
                      *(str(c.get(k, "-")) for k, _ in extra), str(c["load"]),
                      f"{c['cost']:g}", chosen)
    console.print(table)


def cmd_route(args: argparse.Namespace) -> int:
    import asyncio

    from kvatlas.cli import CLIError
    body = prompt_body(args)
    url = router_url(args)
    try:
        status, decision = asyncio.run(fetch_decision(url, body, args.model, args.timeout))
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise unreachable(url, exc, args.timeout) from None
    if status != 200:
        raise CLIError(f"router answered {status}: {error_message(decision)}")
    if args.json:
        print(json.dumps(decision, indent=2))
    else:
        render(decision, Console(width=None if sys.stdout.isatty() else 200))
    return 0
