"""``kvatlas demo``: the README's main command.

It does what ``kvatlas cluster up`` does (embedded etcd, two prefill instances, a decode and the
router, as local processes), then sends a few requests that share a system prompt, and shows
with the real commands why the next one goes where it goes: ``kvatlas index query`` (which
instance holds the longest prefix, read from etcd), ``kvatlas route`` (the router's decision and
each candidate's matched blocks, load and cost) and ``kvatlas generate`` (the text). Then it
brings the cluster down.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from kvatlas.cli import CLIError
from kvatlas.launcher.state import ClusterState
from kvatlas.launcher.supervisor import LocalCluster, StartError
from kvatlas.launcher.topology import Topology

SYSTEM = ("You are kvatlas, a helpful assistant for a team that runs disaggregated LLM serving. "
          "Answer in one short sentence. ")
QUESTIONS = ["What does the prefill do?", "What does the decode do?",
             "Why share a system prompt?"]
OTHER = "A different conversation with nothing in common with the others: tell me a story."


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="start a local PD cluster, show KV-aware routing, stop it")
    p.add_argument("--run-dir", default=".kvatlas/demo", help="run dir (default .kvatlas/demo)")
    p.add_argument("--prefill", type=int, default=2, help="prefill instances (default 2)")
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


def _wait_indexed(run_dir: Path, prompt: str, timeout: float = 15.0) -> dict:
    """Block events reach etcd asynchronously; wait until the prefix shows up in the index."""
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = json.loads(_kvatlas(run_dir, "index", "query", "--model", "tiny", "--prompt",
                                  prompt, "--json", show=False))
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
    topo = Topology(prefill=args.prefill, decode=1, engine_mode=args.engine_mode)
    cluster = LocalCluster(topo, run_dir)
    t0 = time.monotonic()
    print(f"$ kvatlas cluster up --prefill {args.prefill} --decode 1 --run-dir {run_dir}",
          flush=True)
    try:
        cluster.start(timeout=180, progress=lambda n, e: e == "ready" and print(
            f"  {n} ready ({time.monotonic() - t0:.1f}s)", flush=True))
    except StartError as exc:
        raise CLIError(f"cluster did not start: {exc}") from None
    try:
        print(f"router {cluster.state.router['url']}, etcd {cluster.state.etcd}")
        first = SYSTEM + QUESTIONS[0]
        print("\n# 1. a first request with the shared system prompt; its prefill stores the "
              "prompt's KV blocks and publishes them to etcd")
        _kvatlas(run_dir, "generate", "--prompt", first, "--max-new-tokens", "16")
        _wait_indexed(run_dir, first)
        nxt = SYSTEM + QUESTIONS[1]
        print("\n# 2. the global index (etcd) knows which instance holds the shared prefix of "
              "the next prompt")
        _kvatlas(run_dir, "index", "query", "--model", "tiny", "--prompt", nxt)
        print("\n# 3. so the router sends the next prompt there (matched blocks lower its cost)")
        _kvatlas(run_dir, "route", "--prompt", nxt)
        print("\n# 4. ...while a prompt with nothing in common is routed by load")
        _kvatlas(run_dir, "route", "--prompt", OTHER)
        print("\n# 5. generating through the router: the decode receives the prefill's KV "
              "(verified by bootstrap room) and generates")
        for q in QUESTIONS[1:]:
            args_ = ("generate", "--prompt", SYSTEM + q, "--max-new-tokens", "16", "--json")
            print(f"\n$ kvatlas {' '.join(_quote(a) for a in args_)} --run-dir {run_dir}")
            answer = json.loads(_kvatlas(run_dir, *args_, show=False))
            meta = answer.get("meta_info", {})
            print(f"text {answer.get('text')!r}  (tiny is a seeded random model: the text is "
                  f"noise; the point is where its KV came from)")
            print(f"prompt {meta.get('prompt_tokens')} tokens, {meta.get('cached_tokens')} "
                  f"served from the prefill's prefix cache, bootstrap room "
                  f"{meta.get('bootstrap_room')}", flush=True)
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
