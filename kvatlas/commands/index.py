"""``kvatlas index agent|query|stats``: the global KV block index from the command line.

- ``agent`` indexes one engine that publishes KV events (vLLM, SGLang, ours) into etcd.
- ``query`` says which instance holds the longest prefix of a prompt.
- ``stats`` shows each instance's indexed blocks and ingestion counters, then etcd's size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from index.agent import AgentConfig, AgentError, IndexAgent
from index.etcd import EtcdClient
from index.hashing import DEFAULT_BLOCK_SIZE, MAX_TOKEN_ID, block_hashes, namespace_seed
from index.keys import validate_model
from index.record import InstanceRecord
from index.segments import decode
from index.table import BlockTable
from kvatlas.cli import CLIError
from kvatlas.commands._common import stop_on_signals
from kvatlas.commands._index_dump import add_dump_parser
from kvatlas.commands._index_stats import add_stats_parser
from kvatlas.commands._prompt import (
    add_prompt_args,
    chat_messages,
    encode,
    load,
    parse_records,
    tokenizer_source,
)
from kvatlas.commands._run_dir import add_cluster_etcd_args, block_segments, cluster_access
from tokenization.assets import KNOWN_NAMES, is_known

logger = logging.getLogger(__name__)

CLI_ETCD_TIMEOUT = 3.0  # a one-shot command must fail fast when etcd is away

TOKENIZER_HELP = (
    "A prompt given as text (--prompt) or chat messages (--chat, --message) is turned into the ids "
    "the engine prefills by the model's tokenizer: text with its special tokens (BOS where the "
    "tokenizer adds one; --no-bos drops them), messages rendered by its chat template. Without "
    "--tokenizer it is the tokenizer the model's instances publish in etcd, else the model's own "
    "when --model is a known one (smollm2-135m), else the byte tokenizer of kvatlas's reference "
    "models (UTF-8 bytes, BOS 256 first). For other engines pass the ids their tokenizer produced "
    "with --tokens/--tokens-file. Block hashes follow the block hash contract of "
    "docs/architecture.md (chained XXH3, seed 1337, or the --lora/--cache-salt namespace)."
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("index", help="the global KV block index in etcd")
    sub = parser.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    agent = sub.add_parser(
        "agent", help="index an engine's KV events (vLLM, SGLang, kvatlas) into etcd",
        description="Subscribe to one engine's KV events (ZMQ, vLLM/SGLang wire format) and keep "
                    "its blocks in etcd under the instance's lease. With a tcp endpoint on a "
                    "concrete host the engine connects and the agent binds (vLLM's rule); pass "
                    "--kv-events-connect to reach an engine that binds '*'.")
    AgentConfig.add_cli_args(agent)
    add_cluster_etcd_args(agent, index=True)
    agent.set_defaults(func=cmd_agent)

    query = sub.add_parser(
        "query", help="which instance holds the longest prefix of a prompt",
        description="Hash a prompt into blocks and count, per instance, how many leading blocks "
                    "it holds in the etcd index (one snapshot read). " + TOKENIZER_HELP)
    query.add_argument("--model", required=True,
                       help="model whose index to query (served name or alias)")
    add_prompt_args(
        query,
        ("--tokens", {"help": "comma-separated token ids, e.g. 1,2,3 (uint32)"}),
        ("--tokens-file", {"metavar": "FILE", "help": "file of token ids (comma/whitespace "
                           "separated, or a JSON list); - = stdin"}))
    query.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help=f"block size in tokens (default {DEFAULT_BLOCK_SIZE})")
    query.add_argument("--no-bos", action="store_true",
                       help="encode --prompt without special tokens (no BOS)")
    query.add_argument("--lora", default=None, help="LoRA name (changes the hash namespace)")
    query.add_argument("--cache-salt", default=None, help="cache salt (changes the hash namespace)")
    query.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_cluster_etcd_args(query, CLI_ETCD_TIMEOUT, index=True)
    query.set_defaults(func=cmd_query)

    stats = add_stats_parser(sub)
    add_cluster_etcd_args(stats, CLI_ETCD_TIMEOUT, index=True)
    dump = add_dump_parser(sub)
    add_cluster_etcd_args(dump, CLI_ETCD_TIMEOUT, index=True)


def console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 200)


# --- agent -----------------------------------------------------------------------------------


def cmd_agent(args: argparse.Namespace) -> int:
    config = AgentConfig.from_cli_args(args, cluster_access(args))
    try:
        asyncio.run(_serve_agent(config))
    except AgentError as exc:
        raise CLIError(str(exc)) from None
    return 0


async def _serve_agent(config: AgentConfig) -> None:
    """Run until SIGTERM/SIGINT, then revoke the lease so the instance's keys vanish at once."""
    agent = IndexAgent(config)
    await agent.start()
    try:
        stop = stop_on_signals()
        ev = config.events
        print(f"kvatlas index agent: instance {config.instance_id} model {config.model}: KV events "
              f"{'bound at' if ev.binds else 'from'} {agent.subscriber.last_endpoint()}"
              f"{f', replay {ev.replay_endpoint}' if ev.replay_endpoint else ''}; etcd "
              f"{config.etcd.display} prefix {config.etcd_prefix}", flush=True)
        await stop.wait()
    finally:
        await agent.close()
    st = agent.ingestor.stats
    print(f"kvatlas index agent: stopped after {st.applied} events applied, "
          f"{sum(st.rejected.values())} rejected; lease revoked", flush=True)


# --- query -----------------------------------------------------------------------------------


def parse_tokens(text: str, source: str) -> list[int]:
    """Token ids from ``1,2,3`` / whitespace-separated text / a JSON list; CLIError names the bad one."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except ValueError as exc:
            raise CLIError(f"{source}: not a JSON list of token ids: {exc}") from None
        if not isinstance(items, list):
            raise CLIError(f"{source}: expected a JSON list of token ids")
        raw = items
    else:
        raw = [t for t in stripped.replace(",", " ").split() if t]
    if not raw:
        raise CLIError(f"{source}: no token ids given")
    out: list[int] = []
    for i, item in enumerate(raw):
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise CLIError(f"{source}: token #{i} {item!r} is not an integer")
        # int() alone would take "1_000", "+5" and non-ASCII digits such as "\uff11": a token id
        # is plain ASCII decimal digits only (a leading "-" gets through to the range message).
        digits = item[1:] if isinstance(item, str) and item.startswith("-") else item
        if isinstance(digits, str) and not (digits.isascii() and digits.isdigit()):
            raise CLIError(f"{source}: token #{i} {item!r} is not an integer "
                           f"(use ASCII digits 0-9 only)")
        tok = int(item)
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise CLIError(f"{source}: token #{i} {tok} is outside the uint32 range "
                           f"[0, {MAX_TOKEN_ID}]")
        out.append(tok)
    return out


def given_tokens(args: argparse.Namespace) -> list[int] | None:
    """The ids of ``--tokens``/``--tokens-file``; None when the prompt is text or chat."""
    if args.tokens is not None:
        return parse_tokens(args.tokens, "--tokens")
    path = args.tokens_file
    if path is None:
        return None
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CLIError(f"--tokens-file: cannot read {path}: {exc}") from None
    return parse_tokens(text, f"--tokens-file {path}")


async def fetch_index(args: argparse.Namespace, model: str,
                      with_records: bool) -> tuple[BlockTable, list[InstanceRecord]]:
    """Every block segment of ``model`` (one snapshot) as a ``BlockTable``, and, when
    asked, the instance records (which name each instance's tokenizer), in one etcd session."""
    access = cluster_access(args)
    layout = access.layout
    records: list[InstanceRecord] = []
    kvs = await block_segments(args, layout.blocks_prefix(model))
    if with_records:
        async with EtcdClient(access.main_etcd) as client:
            _, inst = await client.get_prefix(layout.instances_prefix())
        records = parse_records(inst, layout.parse_instance)
    table = BlockTable()
    for kv in kvs:
        try:
            _, instance, _ = layout.parse_segment(kv.key)
            seg = decode(kv.value)
        except ValueError:  # MalformedSegment included: written by another tool, not ours
            continue
        for medium, hashes in seg.by_medium().items():
            table.apply_add(instance, hashes, medium)
    return table, records


def query_result(table: BlockTable, tokens: list[int], block_size: int,
                 seed: int) -> dict[str, Any]:
    hashes = block_hashes(tokens, block_size, seed)
    matched = table.lookup(hashes)
    rows = []
    for instance in table.instances():
        m = matched.get(instance, 0)
        rows.append({"instance_id": instance, "matched_blocks": m,
                     "matched_tokens": m * block_size,
                     "fraction": round(m * block_size / len(tokens), 6) if tokens else 0.0})
    rows.sort(key=lambda r: (-r["matched_blocks"], r["instance_id"]))
    return {"prompt_blocks": len(hashes), "instances": rows}


def cmd_query(args: argparse.Namespace) -> int:
    from tokenization import canonical_model
    model = canonical_model(args.model)
    validate_model(model)
    if not 1 <= args.block_size <= 65536:
        raise CLIError(f"--block-size must be within [1, 65536], got {args.block_size}")
    # Every local check (ids, messages, a given tokenizer) before etcd is contacted.
    tokens = given_tokens(args)
    messages = chat_messages(args)
    tokenizer = load(args.tokenizer) if tokens is None and args.tokenizer else None
    seed = namespace_seed(args.lora, args.cache_salt)
    table, records = asyncio.run(fetch_index(args, model, tokens is None and tokenizer is None))
    how = ""
    if tokens is None:
        if tokenizer is None:
            check_known_model(model, table, records, str(args.etcd))
            source = tokenizer_source(None, model, records, str(args.etcd))
            logger.info("model %s: tokenizer %s", model, source)
            tokenizer = load(source)
        tokens = encode(tokenizer, args, messages, add_special_tokens=not args.no_bos)
        how = _how(tokenizer, tokens, messages is not None)
    result = query_result(table, tokens, args.block_size, seed)
    if args.json:
        print(json.dumps(result))
        return 0
    print_query(args, model, tokens, how, result)
    return 0


def check_known_model(model: str, table: BlockTable, records: list[InstanceRecord],
                      where: str) -> None:
    """CLIError listing the models the cluster knows when ``model`` is none of them: no instance
    serves it, no block of it is indexed and tokenization ships no tokenizer for it. Its
    tokenizer would otherwise be guessed (the byte one), and the query answer nothing, silently."""
    served = sorted({r.model for r in records if r.model})
    if model in served or table.instances() or is_known(model):
        return
    listed = ", ".join(served) if served else "none"
    raise CLIError(f"unknown model {model!r}: the instances in etcd at {where} serve {listed}, and "
                   f"tokenizers ship for {', '.join(KNOWN_NAMES)}; pass one of them as --model, "
                   "or --tokenizer/--tokens to query this one anyway")


def _how(tokenizer: Any, tokens: list[int], chat: bool) -> str:
    """How the prompt became ids, for the table's title."""
    what = "chat template of " if chat else ""
    bos = ", BOS first" if tokens and tokens[0] == tokenizer.bos_id else ""
    name = "byte" if tokenizer.kind == "byte" else Path(tokenizer.name).name or tokenizer.name
    return f" ({what}the {name} tokenizer{bos})"


def print_query(args: argparse.Namespace, model: str, tokens: list[int], how: str,
                result: dict[str, Any]) -> None:
    out = console()
    title = (f"model {model}: prompt of {len(tokens)} tokens{how}, "
             f"{result['prompt_blocks']} full blocks of {args.block_size}")
    rows = result["instances"]
    out.print(title, highlight=False)
    if not rows:
        out.print(f"no blocks indexed for model {model}")
        return
    table = Table()
    for col in ("instance", "matched blocks", "matched tokens", "fraction"):
        table.add_column(col, justify="left" if col == "instance" else "right")
    for r in rows:
        table.add_row(r["instance_id"], str(r["matched_blocks"]), str(r["matched_tokens"]),
                      f"{100 * r['fraction']:.1f}%")
    out.print(table)
    if result["prompt_blocks"] == 0:
        out.print(f"the prompt is shorter than one block ({args.block_size} tokens): "
                  "nothing can match")
