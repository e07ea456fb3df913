"""Mixed fleet: PD pairs and aggregated engines in one cluster; the router's per-request choice
between them against always-PD and always-aggregated.

    .venv/bin/python bench/mixed_fleet.py                       # ~3 min on 2 cores
    .venv/bin/python bench/mixed_fleet.py --quick --sweep ""    # < 1 min
    .venv/bin/python bench/mixed_fleet.py --probe               # why long prompts slow down

Every setting starts a fresh local cluster (``bench/_routing_cluster.py``, the routing-quality
bench's): ``--prefills`` prefills of the ``tiny`` model and one decode (the PD pool), and
``--aggregated`` monolithic engines registered as ``aggregated`` instances, all running, each
with a finite prefix cache of ``--pages`` pages, and one kvatlas ``kv_aware`` router discovering
them from etcd:

- ``always_pd``: the aggregated engines register under another etcd key prefix, so the router
  sees only the PD pool (they still run, idle, on the same CPUs);
- ``always_aggregated``: the PD pool registers elsewhere; the router sees the aggregated engines;
- ``choice``: the router sees both and chooses per request (``--disagg-threshold-tokens``, its
  default 512): disaggregated when the best aggregated candidate lacks at least that many
  prompt tokens, aggregated below;
- ``--sweep 128,256,...``: ``choice`` again at each threshold.

The trace (seeded) interleaves short one-shot prompts (~30-90 tokens), long one-shot prompts
(~1,100-1,700 tokens), and multi-turn conversations (a long opener, then short follow-ups on top
of the history). It is replayed through the router's ``/generate`` (``text``, greedy,
``--max-new-tokens``, streamed) at ``--concurrency``; a conversation's turn waits for the one
before. Reported per setting: TTFT p50/p90 of each kind (request sent -> first streamed token
event), throughput (answered requests / wall time of the replay), cached tokens summed over the
prefills and aggregated engines, and the router's decisions by path and reason. Writes
``bench/results/mixed_fleet.json``. Goals (issue 25): short-prompt TTFT p50 >= 1.3x better than
always-PD, long no worse, throughput no worse than the better of the two.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import _routing_trace as rt  # noqa: E402
from _results import write_result  # noqa: E402
from _routing_cluster import run_router  # noqa: E402

from kvatlas.etcd_proc import EtcdCluster  # noqa: E402

KINDS = ("short", "long", "opener", "followup")
"""Request kinds of the trace: short and long one-shot prompts, a conversation's first turn
(long, nothing cached) and its later turns (long, all but the new turn cached somewhere)."""


def mixed_trace(seed: int = 0, short: int = 30, long: int = 12, conversations: int = 6,
                turns: int = 4, max_new_tokens: int = 8) -> tuple[list[rt.Req], dict[int, str]]:
    """The seeded mixed trace and each request's kind (``KINDS``), in a random interleaving."""
    rng = random.Random(seed)
    items: list[tuple[str, Any]] = [("short", None)] * short + [("long", None)] * long
    items += [("conv", c) for c in range(conversations) for _ in range(turns)]
    rng.shuffle(items)
    history: dict[int, str] = {}
    reqs: list[rt.Req] = []
    kinds: dict[int, str] = {}
    for n, (kind, c) in enumerate(items):
        rid = len(reqs)
        session = None
        if kind == "short":
            text = f"q{n}: " + rt._words(rng, rng.randint(30, 90))
        elif kind == "long":
            text = f"doc{n}: " + rt._words(rng, rng.randint(1100, 1700))
        else:
            session = f"conv-{c}"
            if c not in history:
                kind, text = "opener", f"<|system|>\nconv {c}: " + rt._words(rng, 1000) + "\n"
            else:
                kind, text = "followup", history[c]
            text += "<|user|>\n" + rt._words(rng, rng.randint(40, 90)) + "\n<|assistant|>\n"
            history[c] = text + rt._words(rng, 40) + "\n"
        reqs.append(rt.Req(rid, text, max_new_tokens, session=session))
        kinds[rid] = kind
    return reqs, kinds


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)


def summarize(res: dict[str, Any], kinds: dict[int, str]) -> dict[str, Any]:
    """TTFT percentiles per kind and throughput from one replay's result."""
    by_rid = res.pop("ttft_ms_by_rid", {})
    out: dict[str, Any] = {}
    for kind in KINDS:
        xs = [ms for rid, ms in by_rid.items() if kinds[rid] == kind]
        out[kind] = {"n": len(xs), "ttft_p50_ms": pct(xs, 0.5), "ttft_p90_ms": pct(xs, 0.9)}
    out["throughput_rps"] = round(res["ok"] / res["wall_s"], 3) if res.get("wall_s") else None
    view = res.get("router_view") or {}
    out["decisions"] = {k.split(":", 1)[1]: v for k, v in view.items() if k.startswith("disagg:")}
    return out


def settings(sweep: list[int]) -> list[tuple[str, str | None, tuple[str, ...]]]:
    """(name, shape hidden from the router, extra router flags) of each run."""
    runs: list[tuple[str, str | None, tuple[str, ...]]] = [
        ("always_pd", "aggregated", ()), ("always_aggregated", "pd", ()), ("choice", None, ())]
    runs += [(f"choice@{t}", None, ("--disagg-threshold-tokens", str(t))) for t in sweep]
    return runs


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = result["runs"]
    pd = runs.get("always_pd", {}).get("summary", {})
    t = Table(title=f"mixed fleet: {result['trace']['requests']} requests; "
                    f"{result['setup']['prefills']} prefill(s) + 1 decode and "
                    f"{result['setup']['aggregated']} aggregated, {result['setup']['pages']} "
                    f"pages each; concurrency {result['setup']['concurrency']}")
    for col in ("setting", "short p50", "short p90", "long p50", "opener p50", "followup p50",
                "short vs PD", "req/s", "cached tok", "errors", "decisions"):
        t.add_column(col)
    for name, r in runs.items():
        if "error" in r:
            t.add_row(name, *["-"] * 8, r["error"][:40], "-")
            continue
        s = r["summary"]
        base = (pd.get("short") or {}).get("ttft_p50_ms")
        mine = s["short"]["ttft_p50_ms"]
        t.add_row(name, str(mine), str(s["short"]["ttft_p90_ms"]), str(s["long"]["ttft_p50_ms"]),
                  str(s["opener"]["ttft_p50_ms"]), str(s["followup"]["ttft_p50_ms"]),
                  f"{base / mine:.2f}x" if base and mine else "-", str(s["throughput_rps"]),
                  f"{r['cached_tokens']:.0f}", str(r["errors"]),
                  ", ".join(f"{k} {v:.0f}" for k, v in sorted(s["decisions"].items())) or "-")
    Console(width=200).print(t)
    print("TTFT (ms) = request sent to the router -> first streamed token event through it; "
          "short vs PD = always_pd's short-prompt TTFT p50 / this setting's. A shared 2-core "
          "machine: client, router, etcd and every engine contend for the same CPUs.")


def probe(args: argparse.Namespace, etcd: str, logdir: Path, reqs: list[rt.Req],
          kinds: dict[int, str], result: dict[str, Any]) -> int:
    """``--probe``: the three settings of bench/_mixed_probe.py, their summaries and each long
    prompt's prefill under each."""
    import _mixed_probe as mp

    runs: dict[str, dict[str, Any]] = {}
    for i, (name, hide, load) in enumerate(mp.PROBES):
        runs[name] = mp.run_probe(args, etcd, i, logdir, reqs, kinds, name, hide, load)
        s = mp.summary(runs[name])
        result["runs"][name] = s
        print(f"  {name:16s} " + "  ".join(f"{k} p50 {s[k]['p50']} mean {s[k]['mean']}"
                                            for k in ("short", "long", "opener"))
              + f"  prefill call mean {s['prefill_mean_ms']} ms over {s['prefill_calls']:.0f}"
              f", PD TTFT mean {s['pd_ttft_mean_ms']}"
              f"  long at {s['long_where']} {s['long_shapes']}  errors {s['errors']}",
              flush=True)
    result["long_routes"] = mp.long_routes(runs)
    result["rows"] = {name: run["rows"] for name, run in runs.items()}
    write_result(args.out, result)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--aggregated", type=int, default=2)
    p.add_argument("--pages", type=int, default=400,
                   help="KV pool pages (16 tokens) of each prefill and aggregated engine")
    p.add_argument("--decode-pages", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--sweep", default="128,256,1024,2048",
                   help="comma-separated disagg thresholds to run `choice` at as well ('' none)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--probe", action="store_true",
                   help="run always_pd, always_pd+load (short prompts straight to the aggregated "
                        "engines) and choice with per-request routes instead (bench/_mixed_probe.py)")
    p.add_argument("--out", default=None,
                   help="result file (default bench/results/mixed_fleet.json, with --probe "
                        "mixed_fleet_probe.json)")
    args = p.parse_args()
    if args.out is None:
        args.out = str(ROOT / "bench/results" / ("mixed_fleet_probe.json" if args.probe
                                                 else "mixed_fleet.json"))
    sweep = [int(x) for x in args.sweep.split(",") if x]
    kw = (dict(short=12, long=5, conversations=3, turns=3) if args.quick
          else dict(short=30, long=12, conversations=6, turns=4))
    reqs, kinds = mixed_trace(seed=args.seed, max_new_tokens=args.max_new_tokens, **kw)
    # the Cluster reads the routing-quality bench's names
    args.prefill_pages, args.host_pages = args.pages, 0
    result: dict[str, Any] = {
        "trace": {"source": "synthetic mixed", "seed": args.seed, **kw, "requests": len(reqs),
                  "prompt_tokens": rt.total_prompt_tokens(reqs),
                  "by_kind": {k: sum(1 for v in kinds.values() if v == k) for k in KINDS}},
        "setup": {"prefills": args.prefills, "aggregated": args.aggregated, "pages": args.pages,
                  "decode_pages": args.decode_pages, "concurrency": args.concurrency,
                  "max_new_tokens": args.max_new_tokens, "router": "kvatlas kv_aware",
                  "machine": "2 shared CPU cores, no accelerator; figures are of one run"},
        "runs": {}}
    print(f"trace: {len(reqs)} requests {result['trace']['by_kind']}", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="kvatlas-mixed-"))
    t0 = time.monotonic()
    etcd = EtcdCluster(1, log_dir=logdir)
    etcd.start()
    if args.probe:
        try:
            return probe(args, etcd.endpoints, logdir, reqs, kinds, result)
        finally:
            etcd.stop()
    try:
        for i, (name, hide, extra) in enumerate(settings(sweep)):
            try:
                res = run_router(args, etcd.endpoints, "kv_aware", i, logdir, reqs,
                                 fleet="mixed", hide=hide, extra=extra)
                res["summary"] = summarize(res, kinds)
            except RuntimeError as exc:
                res = {"error": str(exc)[:2000]}
            result["runs"][name] = res
            s = res.get("summary")
            print(f"  {name:18s} " + (f"short p50 {s['short']['ttft_p50_ms']} long p50 "
                                      f"{s['long']['ttft_p50_ms']} {s['throughput_rps']} req/s "
                                      f"errors {res['errors']}" if s else
                                      f"ERROR {res['error'][:300]}"), flush=True)
    finally:
        etcd.stop()
    result["total_s"] = round(time.monotonic() - t0, 1)
    result["logs"] = str(logdir)
    print_table(result)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
