"""Sustained load through the router: throughput, errors, latency, memory growth, etcd db size.

Open loop: requests leave at the target rate whatever the latency (so a slow cluster shows up as
latency and errors, not as a politely lower rate), with prompts that share system prefixes the
way chat traffic does. Bounded: 60 s by default, 10 minutes at most.

    .venv/bin/python bench/load.py --duration 60 --rate 4            # starts its own cluster
    .venv/bin/python bench/load.py --run-dir .kvatlas/run --rate 4   # a running `cluster up`

Closed-loop overload (bench/_overload.py says what it measures and the targets), one run per
client count, the cluster started once:

    .venv/bin/python bench/load.py --overload --clients 32,300,600 --prompt-tokens 1800

Memory: RSS of every process of the cluster (each process group: ranks included) after a
warm-up and at the end; growth is reported per process (goal: flat). etcd's db size comes from
its maintenance status. Router restart: on a cluster it started itself, the router is then
killed and launched again, and the time from it listening until ``/readiness`` shows every worker
available and the index live with at least the blocks it had is reported (the fault test
tests/faults/test_restarts.py only waits for that state; the figure is here). Prints a table and
writes bench/results/load.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _overload  # noqa: E402
from _results import write_result  # noqa: E402

from kvatlas.launcher.state import ClusterState, proc_rss  # noqa: E402
from kvatlas.launcher.supervisor import LocalCluster, healthy, http_status  # noqa: E402
from kvatlas.launcher.topology import Topology  # noqa: E402

MAX_DURATION = 600.0
SYSTEMS = [
    "You are a helpful assistant for a bank. Answer briefly and never give financial advice. ",
    "You are a code reviewer. Point out bugs first, style second, and keep each remark short. ",
    "You are a travel agent. Suggest one itinerary with times, and mention the visa rules. ",
]


def group_rss(pid: int) -> int:
    """RSS of a process group (the instance and its rank children), from /proc."""
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "stat").read_text()
            pgid = int(text[text.rfind(")") + 2:].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if pgid == pid:
            total += proc_rss(int(d.name)) or 0
    return total


def memory(state: ClusterState) -> dict[str, int]:
    return {p.name: group_rss(p.pid) for p in state.processes if p.alive()}


def etcd_db_size(state: ClusterState) -> int | None:
    """dbSize of the first etcd endpoint that answers (grpc-gateway maintenance status)."""
    for ep in state.etcd.split(","):
        try:
            req = urllib.request.Request(f"http://{ep}/v3/maintenance/status", data=b"{}",
                                         method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                return int(json.loads(r.read()).get("dbSize", 0))
        except (OSError, ValueError):
            continue
    return None


def readiness(url: str) -> tuple[int, Any]:
    status, body = http_status(f"{url}/readiness", timeout=2.0)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def rebuilt(url: str, blocks: int) -> bool:
    status, ready = readiness(url)
    if status != 200:
        return False
    index = ready["index"]
    return (index["state"] == "live" and index["blocks"] >= blocks
            and all(ready[r]["available"] == ready[r]["total"] > 0 for r in ("prefill", "decode")))


def router_rebuild(cluster: LocalCluster, url: str, timeout: float = 60.0) -> float:
    """Seconds from a relaunched router listening until its pools and index are back."""
    _, before = readiness(url)
    blocks = int(before["index"]["blocks"]) if before else 0
    cluster.kill("router")
    cluster.launch(cluster.service("router"))
    deadline = time.monotonic() + timeout
    while not healthy("router", f"{url}/health", timeout=0.5):
        if time.monotonic() > deadline:
            raise RuntimeError("the relaunched router did not listen")
        time.sleep(0.02)
    listening = time.monotonic()
    while not rebuilt(url, blocks):
        if time.monotonic() > deadline:
            raise RuntimeError("the relaunched router did not rebuild its pools and index")
        time.sleep(0.02)
    return time.monotonic() - listening


def make_prompt(rng: random.Random) -> str:
    system = rng.choice(SYSTEMS)
    turn = rng.randrange(50)
    return f"{system}User {turn}: question number {rng.randrange(1000)} about item {turn}?"


async def one(session: aiohttp.ClientSession, url: str, prompt: str, max_new: int,
              timeout: float) -> tuple[float, str]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/generate", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return time.perf_counter() - t0, "ok" if resp.status == 200 else f"http {resp.status}"
    except TimeoutError:
        return time.perf_counter() - t0, "timeout"
    except aiohttp.ClientError as exc:
        return time.perf_counter() - t0, type(exc).__name__


async def drive(url: str, rate: float, duration: float, max_new: int, timeout: float,
                seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    results: list[tuple[float, str]] = []
    tasks: set[asyncio.Task[None]] = set()
    async with aiohttp.ClientSession() as session:
        async def run(prompt: str) -> None:
            results.append(await one(session, url, prompt, max_new, timeout))

        start = time.perf_counter()
        n = 0
        while True:
            due = start + n / rate
            if due - start >= duration:
                break
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            task = asyncio.create_task(run(make_prompt(rng)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
        if tasks:
            await asyncio.wait(tasks)
    return results


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run-dir", default=None, help="use a running cluster (else start one)")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds (default 60, max 600)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the memory baseline")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens per request (default 8; 32 with --overload)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per request (default 30; 120 with --overload)")
    ap.add_argument("--overload", action="store_true",
                    help="closed loop: --clients concurrent clients, each sending its next "
                         "request when its answer arrives (bench/_overload.py)")
    ap.add_argument("--clients", default="32,300,600",
                    help="--overload: client counts, one run each (default 32,300,600)")
    ap.add_argument("--prompt-tokens", type=int, default=1800,
                    help="--overload: tokens per prompt (default 1800)")
    ap.add_argument("--requests", type=int, default=None,
                    help="--overload: stop a run after this many requests (else --duration)")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--engine-mode", default="pd", choices=("pd", "monolithic"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "load.json"))
    args = ap.parse_args()
    if not 0 < args.duration <= MAX_DURATION:
        ap.error(f"--duration must be within (0, {MAX_DURATION:g}] seconds")
    if not 0 < args.rate <= 10_000:
        ap.error("--rate must be within (0, 10000]")
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.overload else 8
    if args.timeout is None:
        args.timeout = 120.0 if args.overload else 30.0
    clients: list[int] = []
    if args.overload:
        try:
            clients = [int(c) for c in args.clients.split(",")]
        except ValueError:
            ap.error(f"--clients takes counts separated by commas (32,300,600), got "
                     f"{args.clients!r}")
        if not clients or not all(0 < c <= 5000 for c in clients):
            ap.error(f"--clients: each count must be within [1, 5000], got {args.clients!r}")
        if not 1 < args.prompt_tokens <= 100_000:
            ap.error(f"--prompt-tokens must be within [2, 100000], got {args.prompt_tokens}")
        if args.requests is not None and args.requests < 1:
            ap.error(f"--requests must be >= 1, got {args.requests}")
        if args.out == ap.get_default("out"):
            args.out = str(ROOT / "bench" / "results" / "overload.json")

    cluster = None
    tmp = None
    if args.run_dir:
        state = ClusterState.load(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="kvatlas-load-")
        topo = Topology(prefill=args.prefill, decode=args.decode, engine_mode=args.engine_mode,
                        model="tiny")
        cluster = LocalCluster(topo, Path(tmp.name))
        print("starting a cluster ...", flush=True)
        state = cluster.start(timeout=180)
    if args.overload:
        try:
            return overload(args, state, clients)
        finally:
            if cluster is not None:
                cluster.stop()
            if tmp is not None:
                tmp.cleanup()
    try:
        url = state.router["url"]
        asyncio.run(drive(url, args.rate, min(args.warmup, args.duration), args.max_new_tokens,
                          args.timeout, args.seed + 1))
        mem0, db0 = memory(state), etcd_db_size(state)
        t0 = time.perf_counter()
        results = asyncio.run(drive(url, args.rate, args.duration, args.max_new_tokens,
                                    args.timeout, args.seed))
        elapsed = time.perf_counter() - t0
        mem1, db1 = memory(state), etcd_db_size(state)
        rebuild = router_rebuild(cluster, url) if cluster is not None else None
    finally:
        if cluster is not None:
            cluster.stop()
        if tmp is not None:
            tmp.cleanup()

    ok = [lat for lat, status in results if status == "ok"]
    errors: dict[str, int] = {}
    for _, status in results:
        if status != "ok":
            errors[status] = errors.get(status, 0) + 1
    report: dict[str, Any] = {
        "target_rate": args.rate, "duration_s": args.duration, "elapsed_s": round(elapsed, 2),
        "requests": len(results), "ok": len(ok), "errors": errors,
        "throughput_rps": round(len(ok) / elapsed, 3),
        "achieved_over_target": round(len(ok) / elapsed / args.rate, 3),
        "latency_p50_ms": round(pct(ok, 0.50) * 1000, 1),
        "latency_p99_ms": round(pct(ok, 0.99) * 1000, 1),
        "rss_mb": {n: {"start": round(mem0.get(n, 0) / 2 ** 20, 1),
                       "end": round(mem1.get(n, 0) / 2 ** 20, 1),
                       "growth": round((mem1.get(n, 0) - mem0.get(n, 0)) / 2 ** 20, 1)}
                   for n in sorted(set(mem0) | set(mem1))},
        "etcd_db_bytes": {"start": db0, "end": db1},
        "router_rebuild_s": None if rebuild is None else round(rebuild, 3),
        "max_new_tokens": args.max_new_tokens, "engine_mode": state.topology.get("engine_mode"),
        "prefill": state.topology.get("prefill"), "decode": state.topology.get("decode"),
    }
    print(f"\nload: {report['requests']} requests at {args.rate:g}/s for {args.duration:g}s "
          f"({report['prefill']} prefill, {report['decode']} decode, "
          f"{report['engine_mode']} engines)")
    print(f"{'throughput':<22}{report['throughput_rps']:>10} req/s  "
          f"(achieved/target {report['achieved_over_target']})")
    print(f"{'errors':<22}{sum(errors.values()):>10}  {errors or ''}")
    print(f"{'latency p50 / p99':<22}{report['latency_p50_ms']:>10} / "
          f"{report['latency_p99_ms']} ms")
    print(f"{'etcd db size':<22}{str(db0):>10} -> {db1} bytes")
    if rebuild is not None:
        print(f"{'router rebuild':<22}{rebuild:>10.3f} s  (listening -> pools and index back)")
    print(f"{'process':<22}{'rss start':>10}{'rss end':>10}{'growth':>10}  (MB)")
    for n, m in report["rss_mb"].items():
        print(f"{n:<22}{m['start']:>10}{m['end']:>10}{m['growth']:>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0 if not errors else 1


def overload(args: argparse.Namespace, state: ClusterState, clients: list[int]) -> int:
    """One closed-loop run per client count; the table, the JSON, and the targets missed."""
    url = state.router["url"]
    engines = {p.name: p.url for p in state.processes
               if p.role in ("prefill", "decode", "monolithic") and p.url}
    runs = []
    for n in clients:
        print(f"{n} clients, ~{args.prompt_tokens}-token prompts, {args.max_new_tokens} new "
              f"tokens, {args.duration:g} s ...", flush=True)
        results, elapsed = asyncio.run(_overload.drive(
            url, n, args.prompt_tokens, args.max_new_tokens, args.duration, args.requests,
            args.timeout, args.seed))
        pages, idle_s = _overload.pages_after(engines)
        runs.append(_overload.summarize(n, results, elapsed, pages, idle_s))
    missed = _overload.targets(runs)
    print(f"\noverload: {state.topology.get('prefill')} prefill, "
          f"{state.topology.get('decode')} decode ({state.topology.get('engine_mode')} "
          f"engines, model {state.model})")
    _overload.print_table(runs)
    print("targets: " + ("all met" if not missed else "MISSED\n  " + "\n  ".join(missed)))
    write_result(args.out, {
        "mode": "overload", "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens, "duration_s": args.duration,
        "requests_per_run": args.requests, "timeout_s": args.timeout,
        "prefill": state.topology.get("prefill"), "decode": state.topology.get("decode"),
        "engine_mode": state.topology.get("engine_mode"), "runs": runs, "missed": missed})
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
