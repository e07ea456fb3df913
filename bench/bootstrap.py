"""Benchmark of the bootstrap server (issue #2): one run prints everything.

  .venv/bin/python bench/bootstrap.py              # about 40 s
  .venv/bin/python bench/bootstrap.py --seconds 1  # quicker, noisier

A real ``kvatlas bootstrap serve`` process, mirrored into a real etcd, is measured from a client
in this process (aiohttp, one session, as many connections as requests in flight):
1. the time to register 512 ranks (dp 4 x cp 2 x tp 16 x pp 4, 64 PUTs in flight) until
   ``GET /ready`` says 200, and until all 513 keys are in etcd;
2. ``GET /route`` for random rank cells at concurrency 1, 16 and 64: requests/s, p50 and p99.
The limit is measured in the same run: a bare aiohttp server process whose one handler returns
a constant ``{"rank_ip", "rank_port"}`` JSON, hit by the same client the same way. The ratio
says how much of aiohttp's own request cost the bootstrap logic adds. Client and server share
this machine's cores, so the absolute figures are a floor for a dedicated host.

Writes bench/results/bootstrap.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import write_result  # noqa: E402

from index.etcd import EtcdClient, EtcdSettings  # noqa: E402
from index.keys import KeyLayout  # noqa: E402
from kvatlas.etcd_proc import EtcdCluster, free_port  # noqa: E402

DP, CP, TP, PP = 4, 2, 16, 4  # 512 ranks
CONCURRENCY = (1, 16, 64)

HELLO_SERVER = """
import sys
from aiohttp import web
async def route(request):
    return web.json_response({"rank_ip": "10.1.2.3", "rank_port": 20001})
async def health(request):
    return web.Response(text="OK")
app = web.Application()
app.router.add_get("/route", route)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def rank_body(dp: int, cp: int, tp: int, pp: int) -> dict[str, Any]:
    return {
        "attn_tp_size": TP, "attn_tp_rank": tp, "attn_cp_size": CP, "attn_cp_rank": cp,
        "attn_dp_size": DP, "attn_dp_rank": dp, "pp_size": PP, "pp_rank": pp,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": f"10.0.{dp}.{cp * 16 + tp}",
        "rank_port": 20000 + pp, "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": None,
        "dsv41_spec_layout": None, "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
        "prefill_http_port": 30000, "decode_allocation_policy": "early",
    }


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def register_512(url: str, etcd: EtcdClient, layout: KeyLayout, iid: str) -> dict[str, float]:
    cells = [(d, c, t, p) for d in range(DP) for c in range(CP) for t in range(TP) for p in range(PP)]
    random.Random(1).shuffle(cells)
    sem = asyncio.Semaphore(64)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        async def put(cell: tuple[int, int, int, int]) -> None:
            async with sem, s.put(f"{url}/route", json=rank_body(*cell)) as r:
                assert r.status == 200, await r.text()

        t0 = time.perf_counter()
        await asyncio.gather(*(put(c) for c in cells))
        async with s.get(f"{url}/ready") as r:
            assert r.status == 200, await r.text()
        ready_s = time.perf_counter() - t0
        while True:
            _, kvs = await etcd.get_prefix(layout.ranks_prefix(iid), keys_only=True)
            if len(kvs) == len(cells):
                break
            await asyncio.sleep(0.005)
        mirrored_s = time.perf_counter() - t0
    return {"ranks": len(cells), "ready_s": ready_s, "mirrored_s": mirrored_s,
            "puts_per_s": len(cells) / ready_s}


async def load(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    """Closed loop: ``concurrency`` workers each send GET /route back to back for ``seconds``."""
    rng = random.Random(concurrency)
    queries = [{"prefill_dp_rank": str(rng.randrange(DP)), "prefill_cp_rank": str(rng.randrange(CP)),
                "target_tp_rank": str(rng.randrange(TP)), "target_pp_rank": str(rng.randrange(PP))}
               for _ in range(1024)]
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:
        for q in queries[:concurrency * 4]:  # warm the connections
            async with s.get(f"{url}/route", params=q) as r:
                await r.read()
        stop_at = time.perf_counter() + seconds

        async def worker(i: int) -> None:
            n = i
            while time.perf_counter() < stop_at:
                q = queries[n % len(queries)]
                n += concurrency
                t = time.perf_counter()
                async with s.get(f"{url}/route", params=q) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"GET /route answered {r.status}")
                latencies.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - t0
    latencies.sort()
    return {"requests": len(latencies), "rps": len(latencies) / elapsed,
            "p50_ms": percentile(latencies, 0.50) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3}


async def run(seconds: float) -> dict[str, Any]:
    cluster = EtcdCluster(1).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        port, hello_port = free_port(), free_port()
        iid = "bench-p0"
        server = subprocess.Popen(
            [sys.executable, "-m", "kvatlas", "bootstrap", "serve", "--instance-id", iid,
             "--model", "bench/model", "--port", str(port), "--etcd", cluster.endpoints],
            cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
        procs.append(server)
        hello = subprocess.Popen([sys.executable, "-c", HELLO_SERVER, str(hello_port)],
                                 cwd=ROOT, start_new_session=True)
        procs.append(hello)
        url, hello_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{hello_port}"
        wait_healthy(url, server)
        wait_healthy(hello_url, hello)
        etcd = EtcdClient(EtcdSettings.from_text(cluster.endpoints))
        try:
            reg = await register_512(url, etcd, KeyLayout(), iid)
        finally:
            await etcd.close()
        rows = []
        for c in CONCURRENCY:
            ours = await load(url, c, seconds)
            floor = await load(hello_url, c, seconds)
            rows.append({"concurrency": c, "bootstrap": ours, "aiohttp_hello": floor,
                         "rps_ratio": ours["rps"] / floor["rps"]})
        return {"register": reg, "route_get": rows}
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per load step")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "bootstrap.json"))
    args = parser.parse_args()
    result = asyncio.run(run(args.seconds))
    reg = result["register"]
    print(f"register 512 ranks (64 PUTs in flight): ready after {reg['ready_s'] * 1e3:.0f} ms "
          f"({reg['puts_per_s']:.0f} PUT/s), all 512 rank keys in etcd after "
          f"{reg['mirrored_s'] * 1e3:.0f} ms")
    print()
    print(f"{'GET /route':<16}{'conc':>5}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'hello req/s':>13}{'hello p50':>11}{'hello p99':>11}{'ratio':>7}")
    for row in result["route_get"]:
        b, h = row["bootstrap"], row["aiohttp_hello"]
        print(f"{'rank lookup':<16}{row['concurrency']:>5}{b['rps']:>10.0f}{b['p50_ms']:>9.2f}"
              f"{b['p99_ms']:>9.2f}{h['rps']:>13.0f}{h['p50_ms']:>11.2f}{h['p99_ms']:>11.2f}"
              f"{row['rps_ratio']:>7.2f}")
    print("\nratio = bootstrap req/s / bare aiohttp handler req/s (same client, same machine)")
    result["meta"] = {"seconds_per_step": args.seconds, "cpus": os.cpu_count(),
                      "python": platform.python_version(), "aiohttp": aiohttp.__version__,
                      "unix_time": time.time(),
                      "note": "client and servers share the machine's cores"}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
