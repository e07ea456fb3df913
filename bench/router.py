"""Router overhead and throughput vs sglang-router, and the kv_aware decision time at scale.

Part 1: the same stub prefill/decode workers (one separate process) are put behind
  - nothing (the client posts straight to a decode stub: the floor),
  - kvatlas's router (``kvatlas router serve``, PD, kv_aware prefill + power_of_two decode),
  - the same with a random prefill pick (``kvatlas-random``): the work sglang-router does in PD
    mode, where its cache_aware policy falls back to random,
  - sglang-router (``python -m sglang_router.launch_router --pd-disaggregation``, PD, when
    installed: ``pip install sglang-router`` / the ``bench`` extra),
and a closed-loop client at concurrency 1, 16 and 64 posts SGLang ``/generate`` bodies. Reported:
requests/s, p50/p99 latency, and the latency each router adds over the direct path.

Part 2: the routing decision (tokenize + hash + index lookup + cost over 64 prefill instances +
power-of-two decode) timed in-process against a mirror holding 1M blocks. Goal: p99 < 1 ms.

Part 3: CPU per decision (kv_aware, random) with 1, 16, 64, 256 requests held in flight, in
  process: whether the router's own cost grows with the requests in flight.

``--tokenizer SOURCE`` is the tokenizer kvatlas's routers hash prompts with (default ``byte``,
the reference engine's). The real-tokenizer mode, ``--tokenizer smollm2-135m --chat``, sends
OpenAI chat bodies instead: a shared system prompt and a user message new to every request (20k
distinct bodies, more than the tokenizer's prefix cache holds), so each request renders the chat
template and BPE-encodes its new turn; sglang-router, which does not tokenize in PD mode, gets
the very same bodies.

    .venv/bin/python bench/router.py [--duration 4] [--rounds 3] [--concurrency 1 16 64]
    .venv/bin/python bench/router.py --tokenizer smollm2-135m --chat
    .venv/bin/python bench/router.py --vllm-pd     # vLLM PD pairs vs vLLM's toy proxy

Writes bench/results/router.json (router_chat_<tokenizer>.json with --chat;
router_vllm_pd.json with --vllm-pd, bench/_vllm_pd.py: part 1 only, on vLLM-protocol stubs).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _router_load import (  # noqa: E402  (bench/ is on sys.path: this file's directory)
    PROMPT,
    closed_loop,
    post_until_ok,
    proc_cpu,
    serve_apps,
    start,
    stop,
)

from kvatlas.etcd_proc import free_port  # noqa: E402

CHAT_BODIES = 20_000
"""Distinct chat bodies of the --chat mode, cycled through."""


def chat_bodies(n: int = CHAT_BODIES) -> list[bytes]:
    """``n`` chat bodies sharing a system prompt, each with its own user message."""
    rng = random.Random(5)
    words = ["cache", "prefix", "etcd", "decode", "router", "token", "latency", "block", "Grüße",
             "東京", "why", "how", "does", "the", "a", "of", "when", "index", "GPU", "page"]
    out = []
    for i in range(n):
        question = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
        out.append(json.dumps({"messages": [{"role": "system", "content": PROMPT},
                                            {"role": "user", "content": f"#{i}: {question}?"}],
                               "max_tokens": 1}).encode())
    return out


# --- stub workers (run in their own process) ---------------------------------------------------

def serve_stubs(ports: list[int]) -> None:
    async def generate(request: web.Request) -> web.Response:
        body = await request.read()
        json.loads(body)
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 10,
                                                              "completion_tokens": 1}})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "tiny", "is_generation": True,
                                  "tokenizer_path": "tiny", "disaggregation_mode": "null"})

    apps = []
    for port in ports:
        app = web.Application(client_max_size=64 << 20)
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, generate)
        for path in ("/health", "/health_generate", "/get_model_info", "/get_server_info",
                     "/model_info", "/server_info", "/v1/models"):
            app.router.add_get(path, info)
        apps.append((port, app))
    serve_apps(apps)


# --- load -------------------------------------------------------------------------------------

async def wait_ready(url: str, timeout: float = 60.0) -> bool:
    return await post_until_ok(url, b'{"text": "warm"}', "/generate", timeout)


async def measure(name: str, url: str, proc: subprocess.Popen[bytes] | None, conc: int,
                  duration: float, bodies: list[bytes] | None = None) -> dict[str, Any]:
    cpu0 = proc_cpu(proc.pid) if proc else None
    path = "/v1/chat/completions" if bodies else "/generate"
    r = await closed_loop(f"{url}{path}", conc, duration, bodies)
    if proc is not None and cpu0 is not None:
        # CPU the router itself spent per request: independent of how busy the shared
        # machine is, unlike req/s.
        r["router_cpu_us_per_req"] = 1e6 * (proc_cpu(proc.pid) - cpu0) / max(1, r["requests"])
    return r


def sglang_router_available() -> str | None:
    try:
        import sglang_router  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc}); pip install sglang-router"
    return None


async def part1(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(4)]
    prefills = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    decodes = [f"http://127.0.0.1:{p}" for p in ports[2:]]
    stubs = subprocess.Popen([sys.executable, __file__, "--serve-stubs",
                              *map(str, ports)], stdout=subprocess.PIPE, start_new_session=True)
    assert stubs.stdout is not None and stubs.stdout.readline().strip() == b"ready"
    targets: dict[str, str] = {"direct": decodes[0]}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ours_port, sg_port = free_port(), free_port()
    pf_args = [a for u in prefills for a in ("--prefill", u, "none")]
    dc_args = [a for u in decodes for a in ("--decode", u)]
    tok_args = ["--tokenizer", args.tokenizer]
    bodies = chat_bodies() if args.chat else None
    procs["kvatlas"] = start([sys.executable, "-m", "kvatlas", "router", "serve", "--port",
                              str(ours_port), *pf_args, *dc_args, *tok_args],
                             logdir / "kvatlas_router.log")
    targets["kvatlas"] = f"http://127.0.0.1:{ours_port}"
    # The same work sglang-router does in PD mode, where its cache_aware prefill policy falls
    # back to a random pick: separates the HTTP path from the cost of kv_aware's prefix work.
    rnd_port = free_port()
    procs["kvatlas-random"] = start(
        [sys.executable, "-m", "kvatlas", "router", "serve", "--port", str(rnd_port),
         "--prefill-policy", "random", *pf_args, *dc_args, *tok_args],
        logdir / "kvatlas_router_random.log")
    targets["kvatlas-random"] = f"http://127.0.0.1:{rnd_port}"
    if args.asyncio_too:
        aio_port = free_port()
        procs["kvatlas-asyncio"] = start(
            [sys.executable, "-m", "kvatlas", "router", "serve", "--port", str(aio_port),
             "--no-uvloop", *pf_args, *dc_args, *tok_args], logdir / "kvatlas_router_asyncio.log")
        targets["kvatlas-asyncio"] = f"http://127.0.0.1:{aio_port}"
    sg_missing = sglang_router_available()
    if sg_missing is None:
        procs["sglang-router"] = start(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(sg_port), "--pd-disaggregation", *pf_args, *dc_args,
             "--prefill-policy", "cache_aware", "--decode-policy", "power_of_two",
             "--log-level", "warn", "--prometheus-port", str(free_port())],
            logdir / "sglang_router.log")
        targets["sglang-router"] = f"http://127.0.0.1:{sg_port}"
    results: dict[str, Any] = {"sglang_router": sg_missing or "ok", "runs": {},
                               "tokenizer": args.tokenizer, "chat": args.chat}
    try:
        for name, url in list(targets.items()):
            if not await wait_ready(url):
                results["runs"][name] = {"error": f"not ready; see {logdir}/{name}*.log"}
                del targets[name]
        for conc in args.concurrency:
            # Rounds interleave the targets so that a slow spell of this shared machine hits
            # all of them; each target reports its median round.
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for _ in range(args.rounds):
                for name, url in targets.items():
                    rounds[name].append(await measure(name, url, procs.get(name), conc,
                                                      args.duration, bodies))
            for name, per in rounds.items():
                per.sort(key=lambda r: r["rps"])
                r = dict(per[len(per) // 2])
                r["rounds_rps"] = [round(x["rps"]) for x in per]
                results["runs"].setdefault(name, {})[str(conc)] = r
                cpu = r.get("router_cpu_us_per_req")
                print(f"  {name:15s} c={conc:3d}: {r['rps']:8.0f} req/s (rounds "
                      f"{r['rounds_rps']})  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                      f"errors {r['errors']}" + (f"  router CPU {cpu:.0f} us/req" if cpu else ""),
                      flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
        stop(stubs)  # type: ignore[arg-type]
    return results


# --- part 2: decision time ----------------------------------------------------------------------

def part2(instances: int, blocks: int, samples: int, tokenizer: str = "byte") -> dict[str, Any]:
    from index.hashing import block_hashes
    from index.keys import KeyLayout
    from index.mirror import BlockMirror
    from router.config import RouterConfig
    from router.policy import RouteContext
    from router.state import RouterState
    from tokenization import load_tokenizer

    encode_text = load_tokenizer(tokenizer).encode_array

    cfg = RouterConfig(prefill=[(f"http://127.0.0.1:{20000 + i}", None)
                                for i in range(instances)],
                       decode=[f"http://127.0.0.1:{30000 + i}" for i in range(8)], model="tiny")
    state = RouterState(cfg)
    ids = [w.instance_id for w in state.pools.pool("prefill")]
    mirror = BlockMirror(None, KeyLayout(), "tiny")  # type: ignore[arg-type]  # never connects
    # Filled in place, as its watch would (a one-model mirror holds its model's table from the
    # start; before it did, these writes went to a detached table and lookups found nothing).
    table = mirror.table()
    rng = random.Random(0)
    # 1M indexed blocks: 500 shared "system prompts" of 64 blocks, each held by a few instances,
    # plus unique filler so the table really holds `blocks` distinct keys.
    systems = [f"system prompt {i}: " + "policy text " * 90 for i in range(500)]
    sys_hashes = [block_hashes(encode_text(s), 16) for s in systems]
    total = 0
    for hs in sys_hashes:
        for iid in rng.sample(ids, 4):
            table.apply_add(iid, hs)
        total += len(hs)
    filler = blocks - total
    per = filler // instances
    for k, iid in enumerate(ids):
        table.apply_add(iid, range(k * per + (1 << 40), (k + 1) * per + (1 << 40)))
    mirror.ready = True
    state.index = mirror
    assert state.index_lookup(sys_hashes[0], "tiny"), "the index must answer the bench's prompts"
    indexed = len(table)
    prompts = [encode_text(systems[rng.randrange(500)] + f" user question {j} " * 20)
               for j in range(200)]
    lat = []
    for j in range(samples):
        t0 = time.perf_counter()
        state.select_pair(RouteContext(prompts[j % len(prompts)], "tiny"))
        lat.append(time.perf_counter() - t0)
    lat.sort()
    n = len(lat)
    out = {"prefill_instances": instances, "indexed_blocks": indexed,
           "prompt_tokens": len(prompts[0]), "samples": n,
           "p50_us": 1e6 * lat[n // 2], "p99_us": 1e6 * lat[n * 99 // 100],
           "mean_us": 1e6 * statistics.fmean(lat), "goal_p99_us": 1000}
    return out


# --- part 3: decision cost vs requests in flight -------------------------------------------------

def part3(tokenizer: str = "byte", in_flight: tuple[int, ...] = (1, 16, 64, 256),
          decisions: int = 10_000, repeats: int = 3) -> dict[str, Any]:
    """CPU per decision (select + on_routed, kv_aware and random) with ``k`` requests held in
    flight: each decision's pair counts one more running request on its workers, released
    ``k`` decisions later, as the dispatcher does. The router's own cost must not grow with
    the requests in flight (issue 24); the HTTP runs of part 1 mix it with the client's and
    the stubs' CPU on the same machine, this isolates it."""
    import collections
    import dataclasses

    from router.config import RouterConfig
    from router.policy import RouteContext
    from router.state import RouterState
    from tokenization import load_tokenizer

    encode_text = load_tokenizer(tokenizer).encode_array
    prompts = [encode_text(PROMPT + json.loads(b)["messages"][1]["content"])
               for b in chat_bodies(2000)]
    base = RouterConfig(prefill=[("http://127.0.0.1:1", None), ("http://127.0.0.1:2", None)],
                        decode=["http://127.0.0.1:3", "http://127.0.0.1:4"], model="tiny")
    out: dict[str, Any] = {}
    for policy in ("kv_aware", "random"):
        cfg = dataclasses.replace(base, prefill_policy=policy)
        for k in in_flight:
            best = float("inf")
            for r in range(repeats):
                state = RouterState(cfg)
                held: collections.deque[Any] = collections.deque()
                t0 = time.process_time()
                for i in range(decisions):
                    pair = state.select_pair(RouteContext(prompts[(r * decisions + i)
                                                                 % len(prompts)], "tiny"))
                    state.on_routed(pair)
                    pair.prefill.worker.load += 1
                    pair.decode.worker.load += 1
                    held.append(pair)
                    if len(held) > k:
                        done = held.popleft()
                        done.prefill.worker.load -= 1
                        done.decode.worker.load -= 1
                best = min(best, (time.process_time() - t0) / decisions)
            out.setdefault(policy, {})[str(k)] = round(best * 1e6, 1)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-stubs":
        serve_stubs([int(p) for p in sys.argv[2:]])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs per target and concurrency, interleaved; the median is reported")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--tokenizer", default="byte",
                    help="tokenizer kvatlas's routers hash prompts with (default byte; the "
                         "real-tokenizer mode: smollm2-135m, a tokenizer directory or a .gguf)")
    ap.add_argument("--chat", action="store_true",
                    help="send chat bodies with a shared system prompt and a new user turn each")
    ap.add_argument("--asyncio-too", action="store_true",
                    help="also measure kvatlas on the plain asyncio loop (--no-uvloop)")
    ap.add_argument("--vllm-pd", action="store_true",
                    help="vLLM PD pairs (kv_transfer_params, pull) through kvatlas vs vLLM's "
                         "toy proxy, on stub workers (bench/_vllm_pd.py); nothing else")
    args = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="kvatlas-bench-router-"))
    if args.vllm_pd:
        return vllm_pd(args, logdir)
    results: dict[str, Any] = {"cpus": os.cpu_count(), "tokenizer": args.tokenizer,
                               "bodies": "chat" if args.chat else "generate-text"}
    if not args.skip_http:
        print("part 1: HTTP overhead and throughput (closed loop)")
        results["http"] = asyncio.run(part1(args, logdir))
    print(f"part 2: decision time, {args.instances} prefill instances, {args.blocks} blocks")
    results["decision"] = d = part2(args.instances, args.blocks, args.samples, args.tokenizer)
    print(f"  indexed {d['indexed_blocks']} blocks; prompt {d['prompt_tokens']} tokens; "
          f"p50 {d['p50_us']:.0f} us, p99 {d['p99_us']:.0f} us (goal < 1000 us)")
    results["decision_vs_in_flight_us"] = d3 = part3(args.tokenizer)
    print(f"part 3: CPU per decision (us) by requests in flight: {d3}")
    if "http" in results:
        print_table(results["http"])
    name = f"router_chat_{Path(args.tokenizer).name}.json" if args.chat else "router.json"
    out = ROOT / "bench" / "results" / name
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out} (router logs in {logdir})")
    return 0


def vllm_pd(args: argparse.Namespace, logdir: Path) -> int:
    import _vllm_pd
    from _results import write_result
    print("vLLM PD (pull): kvatlas vs vLLM's toy proxy (closed loop)")
    res = asyncio.run(_vllm_pd.run(args, logdir))
    res["cpus"] = os.cpu_count()
    _vllm_pd.print_table(res)
    print(f"ratios kvatlas/proxy req/s: {res['ratios']} (goal >= 1.0)")
    write_result(ROOT / "bench" / "results" / "router_vllm_pd.json", res)
    print(f"router logs in {logdir}")
    return 0


def print_table(http: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    runs = http["runs"]
    direct = runs.get("direct", {})
    what = "/v1/chat/completions" if http.get("chat") else "/generate"
    table = Table(title=f"router overhead vs direct-to-stub (PD, {what}, tokenizer "
                        f"{http.get('tokenizer', 'byte')})")
    for col in ("target", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms",
                "router CPU us/req", "vs sglang-router req/s"):
        table.add_column(col, justify="right")
    for name, per in runs.items():
        if "error" in per:
            table.add_row(name, "-", per["error"], "", "", "", "", "", "")
            continue
        for conc, r in per.items():
            base = direct.get(conc, {})
            sg = runs.get("sglang-router", {}).get(conc)
            ratio = f"{r['rps'] / sg['rps']:.2f}x" if sg and name.startswith("kvatlas") else ""
            cpu = r.get("router_cpu_us_per_req")
            add50 = f"{r['p50_ms'] - base['p50_ms']:.2f}" if base and name != "direct" else ""
            add99 = f"{r['p99_ms'] - base['p99_ms']:.2f}" if base and name != "direct" else ""
            table.add_row(name, conc, f"{r['rps']:.0f}", f"{r['p50_ms']:.2f}",
                          f"{r['p99_ms']:.2f}", add50, add99, f"{cpu:.0f}" if cpu else "",
                          ratio)
    Console(width=140).print(table)
    if http.get("sglang_router") != "ok":
        print(f"sglang-router: {http['sglang_router']}")


if __name__ == "__main__":
    sys.exit(main())
