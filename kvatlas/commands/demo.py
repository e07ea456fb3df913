"""``kvatlas demo``: the README's main command.

It does what ``kvatlas cluster up`` does (embedded etcd, two prefill instances, a decode and the
router, as local processes, serving SmolLM2-135M-Instruct by default), then sends chat requests
that share a system prompt, and shows with the real commands why the next one goes where it
goes: ``kvatlas index query`` (which instance holds the longest prefix, read from etcd),
``kvatlas route`` (the router's decision and each candidate's matched blocks, load and cost) and
``kvatlas generate`` (the model's answer, and how much of its prompt the prefill's prefix cache
served). Then it brings the cluster down.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvatlas.cli import CLIError
from kvatlas.commands.generate import answer_text
from kvatlas.launcher.state import ClusterState
from kvatlas.launcher.supervisor import LocalCluster, StartError
from kvatlas.launcher.topology import DEFAULT_MODEL, Topology

SYSTEM = ("You are a helpful assistant for a geography class. Answer every question with one "
          "short, correct sentence, and do not add anything else. The students are twelve "
          "years old, so keep the words simple.")
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?",
             "What is the capital of Italy?"]
OTHER = "Write a haiku about the sea."


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="start a local PD cluster, show KV-aware routing, stop it")
    p.add_argument("--run-dir", default=".kvatlas/demo", help="run dir (default .kvatlas/demo)")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances (default 2)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"what the engines serve (default {DEFAULT_MODEL}; tiny: the seeded "
                        "byte model, whose text is noise)")
    p.add_argument("--engine-mode", default="pd", choices=("pd", "monolithic"),
                   help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the cluster up until Ctrl-C")
    p.set_defaults(func=run)


def _kvatlas(run_dir: Path, *args: str, show: bool = True) -> str:
    cmd = [sys.executable, "-m", "kvatlas", *args, "--run-dir", str(run_dir)]
    if show:
        print(f"\n$ kvatlas {' '.join(_quote(a) for a in args)} --run-dir {run_dir}", flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if show:
        sys.stdout.write(out.stdout)
        sys.stdout.flush()
    if out.returncode != 0:
        raise CLIError(f"kvatlas {args[0]} failed: {out.stderr.strip()}")
    return out.stdout


def _quote(a: str) -> str:
    return f'"{a}"' if " " in a else a


def _chat(question: str) -> list[str]:
    """The chat of one question, as ``--message`` flags."""
    return ["--message", f"system={SYSTEM}", "--message", f"user={question}"]


def _wait_indexed(run_dir: Path, model: str, question: str, timeout: float = 15.0) -> dict:
    """Block events reach etcd asynchronously; wait until the prefix shows up in the index."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = json.loads(_kvatlas(run_dir, "index", "query", "--model", model, *_chat(question),
                                  "--json", show=False))
        if any(m.get("matched_blocks", 0) for m in doc.get("instances", [])
               if isinstance(m, dict)):
            return doc
        time.sleep(0.3)
    return doc


def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    try:
        if any(p.alive() for p in ClusterState.load(run_dir).processes):
            raise CLIError(f"a cluster is already running from {run_dir}: "
                           f"`kvatlas cluster down --run-dir {run_dir}` first")
    except (FileNotFoundError, ValueError):
        pass
    topo = Topology(prefill=args.prefill, decode=1, engine_mode=args.engine_mode,
                    model=args.model)
    model = topo.served_model
    cluster = LocalCluster(topo, run_dir)
    t0 = time.monotonic()
    print(f"$ kvatlas cluster up --model {args.model} --prefill {args.prefill} --decode 1 "
          f"--run-dir {run_dir}", flush=True)
    try:
        cluster.start(timeout=180, progress=lambda n, e: e == "ready" and print(
            f"  {n} ready ({time.monotonic() - t0:.1f}s)", flush=True))
    except StartError as exc:
        raise CLIError(f"cluster did not start: {exc}") from None
    try:
        print(f"router {cluster.state.router['url']}, etcd {cluster.state.etcd}")
        print("\n# 1. a first chat with the shared system prompt; its prefill stores the "
              "prompt's KV blocks and publishes them to etcd")
        _kvatlas(run_dir, "generate", *_chat(QUESTIONS[0]), "--max-new-tokens", "32")
        _wait_indexed(run_dir, model, QUESTIONS[0])
        print("\n# 2. the global index (etcd) knows which instance holds the shared prefix of "
              "the next chat (its tokens are the model's chat template, rendered and tokenized "
              "as the engines do)")
        _kvatlas(run_dir, "index", "query", "--model", model, *_chat(QUESTIONS[1]))
        print("\n# 3. so the router sends the next chat there (matched blocks lower its cost)")
        _kvatlas(run_dir, "route", *_chat(QUESTIONS[1]))
        print("\n# 4. ...while a chat with nothing in common is routed by load")
        _kvatlas(run_dir, "route", "--message", f"user={OTHER}")
        print("\n# 5. chatting through the router: the decode receives the prefill's KV "
              "(verified by bootstrap room) and generates")
        for q in QUESTIONS[1:]:
            args_ = ("generate", *_chat(q), "--max-new-tokens", "32", "--json")
            print(f"\n$ kvatlas generate --message \"user={q}\" (system prompt as above) "
                  f"--json --run-dir {run_dir}")
            answer = json.loads(_kvatlas(run_dir, *args_, show=False))
            usage = answer.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            print(f"answer {answer_text('/v1/chat/completions', answer).strip()!r}")
            print(f"prompt {usage.get('prompt_tokens')} tokens, {cached} served from the "
                  f"prefill's prefix cache", flush=True)
        _kvatlas(run_dir, "cluster", "status")
        if args.keep:
            print("\nrunning; Ctrl-C to stop")
            while True:
                time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        print(f"\n$ kvatlas cluster down --run-dir {run_dir}", flush=True)
        cluster.stop()
        left = [p.name for p in cluster.state.processes if p.alive()]
        print("stopped everything; nothing left running" if not left
              else f"still running: {left}")
    print(f"demo done in {time.monotonic() - t0:.0f}s")
    return 0
