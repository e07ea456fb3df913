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
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import _routing_trace as rt  # noqa: E402
from _results import write_result
from _routing_report import print_table  # noqa: E402

from kvatlas.etcd_proc import EtcdCluster, free_port  # noqa: E402

ROUTERS = ("kv_aware", "kv_aware:gpu_only", "kv_aware:no_share", "round_robin", "power_of_two",
           "sglang:cache_aware")
VARIANTS = {
    "kv_aware:gpu_only": ("--host-hit-weight", "0", "--disk-hit-weight", "0"),
    "kv_aware:no_share": ("--no-share-predictions",),
}
"""kvatlas router flags of a variant: ``gpu_only`` credits no host or disk block, as a router
that forgets a block when its GPU copy goes (the baseline of tier-aware scoring); ``no_share``
keeps each router's predictions to itself (the baseline of shared predictions, with
``--router-counts``)."""
MODEL = "tiny"


# --- processes ----------------------------------------------------------------------------------

class Proc:
    """One subprocess in its own process group (its rank children die with it)."""

    def __init__(self, name: str, args: list[str], logdir: Path) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("KVATLAS_LOG_LEVEL", "WARNING")
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self.log_path.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(8)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def wait_until(check, procs: list[Proc], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        if check():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)$", line)
        if m:
            total += float(m.group(1))
    return total


class Cluster:
    """Fresh prefills + one decode under a new etcd key prefix, and one router in front."""

    def __init__(self, args: argparse.Namespace, etcd: str, prefix: str, logdir: Path) -> None:
        self.args, self.etcd, self.prefix, self.logdir = args, etcd, prefix, logdir
        self.prefills: list[dict[str, Any]] = []
        self.decode: dict[str, Any] = {}
        self.procs: list[Proc] = []
        self.router_url = ""
        self.router_urls: list[str] = []
        """Every router of the run (``--router-counts``): requests are sprayed across them."""
        self.router_proc: Proc | None = None

    def _engine(self, mode: str, name: str, pages: int) -> dict[str, Any]:
        port = free_port()
        args = [sys.executable, "-m", "kvatlas", "engine", "serve", "--mode", mode,
                "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
                "--num-pages", str(pages), "--instance-id", name,
                "--etcd", self.etcd, "--etcd-prefix", self.prefix]
        info: dict[str, Any] = {"name": name, "url": f"http://127.0.0.1:{port}"}
        if mode == "prefill":
            info["bport"] = free_port()
            args += ["--bootstrap-port", str(info["bport"]),
                     "--host-pages", str(getattr(self.args, "host_pages", 0))]
        info["proc"] = Proc(f"{self.prefix.strip('/')}-{name}", args, self.logdir)
        self.procs.append(info["proc"])
        return info

    def start_workers(self) -> None:
        a = self.args
        self.prefills = [self._engine("prefill", f"prefill-{i}", a.prefill_pages)
                         for i in range(a.prefills)]
        self.decode = self._engine("decode", "decode-0", a.decode_pages)

        def ready() -> bool:
            for w in [*self.prefills, self.decode]:
                if http_get(w["url"] + "/health")[0] != 200:
                    return False
                if "bport" in w and http_get(f"http://127.0.0.1:{w['bport']}/ready")[0] != 200:
                    return False
            return True

        wait_until(ready, self.procs, "engine instances", 180)

    def start_routers(self, router: str, count: int) -> None:
        for k in range(count):
            self.start_router(router, k)
            self.router_urls.append(self.router_url)
        self.router_url = self.router_urls[0]

    def start_router(self, router: str, k: int = 0) -> None:
        port = free_port()
        self.router_url = f"http://127.0.0.1:{port}"
        if router.startswith("sglang:"):
            pf = [x for w in self.prefills for x in ("--prefill", w["url"], str(w["bport"]))]
            args = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--pd-disaggregation", *pf,
                    "--decode", self.decode["url"], "--policy", router.split(":")[1],
                    "--log-level", "debug",
                    "--prometheus-port", str(free_port()),
                    *getattr(self.args, "sglang_arg", [])]
        else:
            args = [sys.executable, "-m", "kvatlas", "router", "serve", "--host", "127.0.0.1",
                    "--port", str(port), "--etcd", self.etcd, "--etcd-prefix", self.prefix,
                    "--model", MODEL, "--policy", router.split(":")[0],
                    "--decode-policy", "power_of_two", "--health-check-interval-secs", "1",
                    *VARIANTS.get(router, ()),
                    *getattr(self.args, "kvatlas_arg", [])]
        proc = Proc(f"{self.prefix.strip('/')}-router{k}", args, self.logdir)
        self.router_proc = proc
        self.procs.append(proc)

        def ready() -> bool:
            if http_get(self.router_url + "/readiness")[0] != 200:
                return False
            if router.startswith("sglang:"):
                return True
            code, body = http_get(self.router_url + "/workers")
            if code != 200:
                return False
            text = json.dumps(json.loads(body))
            return all(w["name"] in text for w in self.prefills)

        wait_until(ready, [proc], f"router {router}", 60)

    def prefill_metrics(self) -> dict[str, float]:
        out = {"cached_tokens": 0.0, "prefill_computed_tokens": 0.0, "prompt_tokens": 0.0,
               "requests": 0.0, "kv_evictions": 0.0}
        per = []
        for w in self.prefills:
            code, text = http_get(w["url"] + "/metrics", timeout=5)
            if code != 200:
                raise RuntimeError(f"{w['name']} /metrics answered {code}")
            row = {k: metric(text, f"kvatlas_engine_{k}_total")
                   or metric(text, f"kvatlas_engine_{k}") for k in out}
            per.append({"instance": w["name"], **row})
            for k in out:
                out[k] += row[k]
        return {**out, "per_instance": per}  # type: ignore[dict-item]

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


# --- per-router run ----------------------------------------------------------------------------

def router_diag(url: str) -> dict[str, float]:
    """kvatlas router's own view: predicted prefix-hit tokens, index size, shared predictions."""
    code, text = http_get(url + "/metrics", timeout=5)
    if code != 200:
        return {}
    out = {key: metric(text, f"kvatlas_router_{name}")
           for key, name in (("prefix_hit_tokens", "prefix_hit_tokens_total"),
                             ("index_blocks", "index_blocks"),
                             ("predicted_blocks", "predicted_blocks"),
                             ("index_ready", "index_ready"),
                             ("prediction_puts", "shared_prediction_puts_total"),
                             ("prediction_bytes", "shared_prediction_bytes_total"))}
    for direction in ("sent", "received", "stale"):
        out[f"shared_{direction}"] = metric(
            text, f'kvatlas_router_shared_predictions_total{{direction="{direction}"}}')
    return out


def etcd_puts(endpoint: str) -> float:
    """Puts etcd has applied since it started (its own /metrics)."""
    code, text = http_get(f"http://{endpoint}/metrics", timeout=5)
    return metric(text, "etcd_mvcc_put_total") if code == 200 else float("nan")


def sglang_diag(log: Path) -> dict[str, int]:
    """sglang-router's debug log: how many prefill selections its cache_aware policy made from
    its radix tree, and how many fell back to a random worker ("No tree found for model")."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return {}
    return {"pd_selections": text.count("Selecting PD pair"),
            "random_fallbacks": text.count("No tree found for model")}


def run_router(args: argparse.Namespace, etcd: str, router: str, i: int, logdir: Path,
               reqs: list[rt.Req], count: int = 1) -> dict[str, Any]:
    t0 = time.monotonic()
    for attempt in range(3):
        # free_port() can race with other processes on the box: retry on a lost port
        cluster = Cluster(args, etcd, f"/rq{os.getpid()}x{i}a{attempt}", logdir)
        try:
            cluster.start_workers()
            cluster.start_routers(router, count)
            break
        except BaseException as exc:  # Ctrl-C included: never leave a process behind
            cluster.stop()
            if "address already in use" not in str(exc) or attempt == 2:
                raise
            print(f"  {router}: a port was taken meanwhile; starting again", flush=True)
    try:
        startup = time.monotonic() - t0
        puts0 = etcd_puts(etcd.split(",")[0])
        res = asyncio.run(rt.replay(cluster.router_urls, reqs, args.concurrency,
                                    args.request_timeout))
        time.sleep(0.3)
        res["etcd_puts"] = etcd_puts(etcd.split(",")[0]) - puts0
        res.update(cluster.prefill_metrics())
        served = [row["requests"] for row in res["per_instance"]]
        # How evenly the requests went: max over mean of each prefill's (1.0: perfectly even).
        res["spread"] = (max(served) / (sum(served) / len(served))) if sum(served) else None
        if router.startswith("sglang:") and cluster.router_proc is not None:
            res["router_view"] = sglang_diag(cluster.router_proc.log_path)
        else:
            views = [router_diag(u) for u in cluster.router_urls]
            res["router_view"] = {k: sum(v.get(k, 0.0) for v in views)
                                  for k in {k for v in views for k in v}}
        res["routers"] = count
        res["startup_s"] = round(startup, 1)
        return res
    finally:
        cluster.stop()


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
    p.add_argument("--prefills", type=int, default=3)
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
    p.add_argument("--routers", default=",".join(ROUTERS),
                   help=f"comma-separated subset of {','.join(ROUTERS)}")
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
    routers = [r for r in args.routers.split(",") if r]
    for r in routers:
        if r not in ROUTERS:
            p.error(f"unknown router {r!r}")
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
        "setup": {"prefills": n, "prefill_pages": args.prefill_pages,
                  "host_pages": args.host_pages, "page_size": rt.BLOCK, "model": MODEL,
                  "decode_pages": args.decode_pages, "concurrency": args.concurrency,
                  "max_new_tokens": args.max_new_tokens,
                  "ttft": "request sent -> first streamed token event through the router"},
        "offline": offline, "runs": {}}
    print(f"trace: {len(reqs)} requests, {total} prompt tokens, "
          f"{result['trace']['distinct_blocks']} distinct blocks; {n} prefills x "
          f"{args.prefill_pages} pages + {args.host_pages} host; "
          f"oracle {offline['oracle_belady']} tokens", flush=True)
    logdir = Path(tempfile.mkdtemp(prefix="kvatlas-rq-"))
    t0 = time.monotonic()
    etcd = EtcdCluster(1, log_dir=logdir)
    etcd.start()
    try:
        counts = [int(c) for c in args.router_counts.split(",") if c]
        runs = [(r, c) for r in routers for c in (counts if not r.startswith("sglang:")
                                                  else [1])]
        for i, (router, count) in enumerate(runs):
            t1 = time.monotonic()
            try:
                res = run_router(args, etcd.endpoints, router, i, logdir, reqs, count)
            except RuntimeError as exc:
                res = {"error": str(exc)[:2000]}
            if count != 1:
                router = f"{router} x{count}"
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
    result["total_s"] = round(time.monotonic() - t0, 1)
    result["logs"] = str(logdir)
    print_table(result)
    print(f"ratios: {result['ratios']}  total {result['total_s']} s  logs {logdir}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
