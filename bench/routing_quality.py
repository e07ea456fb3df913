"""Routing quality: prefix-cache hits and TTFT of PD routers on a reuse-heavy trace.

    .venv/bin/python bench/routing_quality.py            # default trace, ~5 min on 2 cores
    .venv/bin/python bench/routing_quality.py --quick    # smaller trace, < 2 min
    .venv/bin/python bench/routing_quality.py --trace mooncake.jsonl --limit 200

For each router under test the bench starts a fresh local cluster (embedded etcd shared, but a
new key prefix per run): N prefill instances (default 3) of the ``tiny`` model with a FINITE
prefix cache (``--prefill-pages`` pages of 16 tokens each, sized so that the trace's working set
does not fit one instance but does fit their union), one decode, and the router:

- ``kv_aware``, ``round_robin``, ``power_of_two``: ``kvatlas router serve`` discovering the
  workers from etcd (``--model tiny`` so it follows the prefills' block index);
- ``kv_aware:gpu_only`` and ``kv_aware:no_share``: kv_aware crediting no host or disk block,
  and kv_aware keeping its predictions to itself (``VARIANTS``);
- ``sglang:cache_aware``: sglang-router (PyPI ``sglang-router``) in PD mode in front of the same
  kind of workers, given them as static ``--prefill URL BOOTSTRAP_PORT`` / ``--decode URL`` with
  ``--policy cache_aware``. It runs at ``--log-level debug`` so that the bench can count how many
  of its selections fell back to a random worker ("No tree found for model"): sglang-router 0.3.2
  does that for every PD request here, and the table says so rather than hiding it.

``--fleet aggregated``: the same with N aggregated engines (``--mode monolithic --etcd``, the same
finite prefix cache) and no decode: one request goes to one engine. The kvatlas routers discover
them from etcd (kv_aware ranks them by index match against load); sglang-router runs in REGULAR
mode (``--worker-urls URL... --policy cache_aware``, its approximate text tree per worker). Cached
tokens are then summed over the aggregated engines.

``--fleet vllm-pd``: the pd fleet speaking vLLM's PD protocol (NixlConnector's
``kv_transfer_params``): every engine runs ``--pd-protocol vllm-pull`` or ``vllm-push``, the router
reads the protocol from the records, and the trace goes in as OpenAI ``/v1/completions`` bodies.
``--vllm-mode pull|push|both`` (default both): with both, every router runs in each mode (push runs
are named ``ROUTER@push``) and the ratios include push's TTFT over pull's. Routers default to
kv_aware and round_robin (sglang-router does not speak the protocol).

Traces: ``--shape chat`` (default), ``rounds`` (the host-tier scenario: every conversation
takes turn t before any takes turn t+1, with ``--host-pages``) and ``hot`` (a burst of 256
requests sharing a 32-block prefix, all at once: the load-imbalance scenario), or ``--trace``
(Mooncake JSONL). ``--router-counts 1,2,4`` runs each kvatlas router that many times side by
side, the requests sprayed over them, and reports what sharing predictions cost in etcd puts.

The trace (``bench/_routing_trace.py``) is replayed in order through the router's ``/generate``
with ``text`` prompts (every router sees the same body), greedy, a few output tokens, streamed,
at a bounded concurrency; turns of one conversation wait for the previous turn to finish.

Reported per router:

- cached tokens: the sum over the PREFILL instances of ``kvatlas_engine_cached_tokens`` (their
  ``/metrics``), i.e. prompt tokens the prefill took from its own prefix cache. Decode-side caching
  plays no part (the decode receives the KV). The decode's per-response ``meta_info.cached_tokens``
  (which carries the prefill's count across the transfer) is summed as a cross-check;
- prefill tokens computed: ``kvatlas_engine_prefill_computed_tokens`` summed over the prefills;
- TTFT p50/p90: time from sending the request to the router until the first streamed SSE event
  with a token arrives through it (prefill, KV transfer and the first decode step included);
- end-to-end p50 and the wall time of the replay.

Offline, on the same trace and capacities (see ``bench/_routing_trace.py``): the oracle (Belady
upper bound on any routing's hits), the infinite-cache bound, and LRU simulations of round robin
and a perfect-information prefix-affinity router as references. Prints a table with ratios vs
round robin and vs sglang cache_aware, and writes ``bench/results/routing_quality.json``.
Goal (issue #6): kv_aware >= 1.5x round robin's cached tokens, and more than cache_aware.
"""
from __future__ import annotations

import argparse
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
from _routing_cluster import MODEL, run_router  # noqa: E402
from _routing_report import print_table  # noqa: E402

from kvatlas.etcd_proc import EtcdCluster  # noqa: E402

VLLM_ROUTERS = ("kv_aware", "round_robin")
ROUTERS = ("kv_aware", "kv_aware:gpu_only", "kv_aware:no_share", "round_robin", "power_of_two",
           "sglang:cache_aware")


def vllm_ratios(runs: dict[str, Any]) -> dict[str, Any]:
    """The vllm-pd fleet's: kv_aware over round robin in push mode (pull's is the plain one),
    and each router's push TTFT p50 over its pull TTFT p50 (< 1: push is faster)."""
    def get(name: str, key: str) -> float | None:
        r = runs.get(name, {})
        return r.get(key) if "error" not in r else None

    kv, rr = get("kv_aware@push", "cached_tokens"), get("round_robin@push", "cached_tokens")
    out: dict[str, Any] = {"kv_aware_vs_round_robin@push": round(kv / rr, 3) if kv and rr
                           else None}
    for name in runs:
        if name.endswith("@push"):
            pull, push = get(name[:-5], "ttft_p50_ms"), get(name, "ttft_p50_ms")
            out[f"{name[:-5]}_push_vs_pull_ttft_p50"] = (round(push / pull, 3)
                                                         if pull and push else None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller trace (< 2 min)")
    p.add_argument("--trace", default=None, help="Mooncake-format JSONL trace instead")
    p.add_argument("--shape", choices=("chat", "rounds", "hot"), default="chat",
                   help="synthetic trace: chat (random interleaving, shared system prompts), "
                        "rounds (every conversation's turn t before any turn t+1: the host-tier "
                        "scenario, with --host-pages) or hot (256 requests sharing a 32-block "
                        "prefix, all sent at once: the load-imbalance scenario)")
    p.add_argument("--limit", type=int, default=None, help="first N requests of --trace")
    p.add_argument("--mooncake-block-chars", type=int, default=64,
                   help="characters per Mooncake hash id (its 512 tokens, scaled down)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefills", type=int, default=3,
                   help="prefill instances (with --fleet aggregated: aggregated engines)")
    p.add_argument("--fleet", choices=("pd", "aggregated", "vllm-pd"), default="pd",
                   help="pd: prefills + one decode; aggregated: monolithic engines registered "
                        "as aggregated instances (sglang-router then runs in regular mode); "
                        "vllm-pd: the pd fleet on vLLM's PD protocol (kv_transfer_params)")
    p.add_argument("--vllm-mode", choices=("pull", "push", "both"), default="both",
                   help="--fleet vllm-pd: the engines' mode (vllm-pull / vllm-push); both runs "
                        "each router in each mode")
    p.add_argument("--prefill-pages", type=int, default=None,
                   help="KV pool pages per prefill = its prefix-cache capacity (default 300; "
                        "quick 200)")
    p.add_argument("--router-counts", default="1",
                   help="comma-separated numbers of kvatlas routers per run, e.g. 1,2,4: the "
                        "requests (every turn of a conversation) are sprayed across them")
    p.add_argument("--host-pages", type=int, default=0,
                   help="each prefill's host tier in blocks (evicted blocks move there and back "
                        "on a hit; the oracle then has device + host capacity)")
    p.add_argument("--decode-pages", type=int, default=4096)
    p.add_argument("--concurrency", type=int, default=None,
                   help="requests in flight (default 6; the hot shape: all of them)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--routers", default=None,
                   help=f"comma-separated subset of {','.join(ROUTERS)} (default: all; "
                        "vllm-pd: kv_aware,round_robin)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--kvatlas-arg", action="append", default=[],
                   help="extra kvatlas router flag (repeatable): --kvatlas-arg=--prediction-ttl "
                        "--kvatlas-arg=5")
    p.add_argument("--sglang-arg", action="append", default=[],
                   help="extra sglang-router flag (repeatable): --sglang-arg=--cache-threshold "
                        "--sglang-arg=0.5")
    p.add_argument("--out", default=str(ROOT / "bench/results/routing_quality.json"))
    args = p.parse_args()
    if args.trace:
        reqs = rt.mooncake_trace(args.trace, args.mooncake_block_chars,
                                 max_new_tokens=args.max_new_tokens, limit=args.limit)
        trace_desc: dict[str, Any] = {"source": args.trace}
    elif args.shape == "hot":
        kw = dict(requests=64 if args.quick else 256)
        reqs = rt.hot_prefix_trace(seed=args.seed, max_new_tokens=args.max_new_tokens, **kw)
        trace_desc = {"source": "synthetic hot prefix", "seed": args.seed, **kw}
        if args.concurrency is None:
            args.concurrency = len(reqs)  # the whole burst at once
    elif args.shape == "rounds":
        kw = dict(conversations=18 if args.quick else 36, turns=4, opener_chars=300)
        reqs = rt.rounds_trace(seed=args.seed, max_new_tokens=args.max_new_tokens, **kw)
        trace_desc = {"source": "synthetic rounds", "seed": args.seed, **kw}
    elif args.quick:
        kw = dict(groups=6, system_chars=800, conversations=18, turns=4, active=8,
                  reply_chars=60)
        reqs = rt.synthetic_trace(seed=args.seed, max_new_tokens=args.max_new_tokens, **kw)
        trace_desc = {"source": "synthetic", "seed": args.seed, **kw}
    else:
        kw = dict(groups=12, system_chars=700, conversations=60, turns=4, active=12,
                  reply_chars=60)
        reqs = rt.synthetic_trace(seed=args.seed, max_new_tokens=args.max_new_tokens, **kw)
        trace_desc = {"source": "synthetic", "seed": args.seed, **kw}
    if args.concurrency is None:
        args.concurrency = 6
    if args.prefill_pages is None:
        args.prefill_pages = 200 if args.quick else 300
    if args.routers is None:
        args.routers = ",".join(VLLM_ROUTERS if args.fleet == "vllm-pd" else ROUTERS)
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            p.error(f"unknown router {r!r}")
    if args.fleet == "vllm-pd" and any(r.startswith("sglang:") for r in routers):
        p.error("sglang-router does not speak vLLM's PD protocol: drop it from --routers")
    if any(r.startswith("sglang:") for r in routers):
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            print("sglang-router not installed (pip install sglang-router): skipping cache_aware")
            routers = [r for r in routers if not r.startswith("sglang:")]
    n = args.prefills
    cap = args.prefill_pages + args.host_pages  # what an instance can hold, device + host
    total = rt.total_prompt_tokens(reqs)
    offline = {
        "union_blocks": cap * n,
        "oracle_belady": rt.belady_bound(reqs, cap * n),
        "infinite_cache": rt.infinite_bound(reqs),
        "sim_round_robin": rt.simulate(reqs, n, cap, "round_robin"),
        "sim_affinity": rt.simulate(reqs, n, cap, "greedy"),
    }
    result: dict[str, Any] = {
        "trace": {**trace_desc, "requests": len(reqs), "prompt_tokens": total,
                  "distinct_blocks": rt.distinct_blocks(reqs),
                  "max_prompt_tokens": max(len(rt.prompt_tokens(r.text)) for r in reqs)},
        "setup": {"fleet": args.fleet, "vllm_mode": args.vllm_mode if args.fleet == "vllm-pd"
                  else None, "prefills": n, "prefill_pages": args.prefill_pages,
                  "host_pages": args.host_pages, "page_size": rt.BLOCK, "model": MODEL,
                  "decode_pages": args.decode_pages, "concurrency": args.concurrency,
                  "max_new_tokens": args.max_new_tokens,
                  "ttft": "request sent -> first streamed token event through the router"},
        "offline": offline, "runs": {}}
    print(f"trace: {len(reqs)} requests, {total} prompt tokens, "
          f"{result['trace']['distinct_blocks']} distinct blocks; {n} {args.fleet} cache "
          f"workers x "
          f"{args.prefill_pages} pages + {args.host_pages} host; "
          f"oracle {offline['oracle_belady']} tokens", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="kvatlas-rq-"))
    t0 = time.monotonic()
    etcd = EtcdCluster(1, log_dir=logdir)
    etcd.start()
    try:
        counts = [int(c) for c in args.router_counts.split(",") if c]
        modes = ((["pull", "push"] if args.vllm_mode == "both" else [args.vllm_mode])
                 if args.fleet == "vllm-pd" else [None])
        runs = [(r, c, m) for m in modes for r in routers
                for c in (counts if not r.startswith("sglang:") else [1])]
        for i, (router, count, mode) in enumerate(runs):
            t1 = time.monotonic()
            args.vllm_mode = mode
            try:
                res = run_router(args, etcd.endpoints, router, i, logdir, reqs, count,
                                 fleet=args.fleet)
            except RuntimeError as exc:
                res = {"error": str(exc)[:2000]}
            res.pop("ttft_ms_by_rid", None)
            if count != 1:
                router = f"{router} x{count}"
            if mode == "push":
                router = f"{router}@push"
            result["runs"][router] = res
            if "error" in res:
                print(f"  {router}: ERROR {res['error'][:500]}", flush=True)
            else:
                print(f"  {router:20s} cached {res['cached_tokens']:.0f} (meta "
                      f"{res['meta_cached_tokens']}) computed {res['prefill_computed_tokens']:.0f}"
                      f" TTFT p50 {res['ttft_p50_ms']} p90 {res['ttft_p90_ms']} ms, errors "
                      f"{res['errors']}, {time.monotonic() - t1:.0f} s", flush=True)
    finally:
        etcd.stop()
    rr = result["runs"].get("round_robin", {}).get("cached_tokens")
    ca = result["runs"].get("sglang:cache_aware", {}).get("cached_tokens")
    kv = result["runs"].get("kv_aware", {}).get("cached_tokens")
    gpu = result["runs"].get("kv_aware:gpu_only", {}).get("cached_tokens")
    multi = {name: round(r["cached_tokens"] / kv, 3) for name, r in result["runs"].items()
             if name.startswith("kv_aware x") and kv and r.get("cached_tokens")}
    result["ratios"] = {
        **{f"{name}_vs_one_router": v for name, v in multi.items()},
        "kv_aware_vs_gpu_only": round(kv / gpu, 3) if kv and gpu else None,
        "kv_aware_vs_round_robin": round(kv / rr, 3) if kv and rr else None,
        "kv_aware_vs_cache_aware": round(kv / ca, 3) if kv and ca else None,
        "kv_aware_vs_oracle": round(kv / offline["oracle_belady"], 3) if kv else None,
        "goal": "kv_aware >= 1.5x round_robin and > sglang cache_aware"}
    if args.fleet == "vllm-pd":
        result["ratios"].update(vllm_ratios(result["runs"]))
    result["total_s"] = round(time.monotonic() - t0, 1)
    result["logs"] = str(logdir)
    print_table(result)
    print(f"ratios: {result['ratios']}  total {result['total_s']} s  logs {logdir}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
