"""``bench/router.py --vllm-pd``: routing vLLM PD pairs (NixlConnector's ``kv_transfer_params``,
pull mode) through kvatlas's router vs vLLM's own toy proxy.

Stub workers (one separate process, :func:`serve_stubs`): two prefills that answer a request whose
``kv_transfer_params`` has ``do_remote_decode`` with one token and a top-level ``kv_transfer_params``
of vLLM 0.33's pull shape (engine id, block ids, the engine's request id ``cmpl-<X-Request-Id>-<8
hex>``), and two decodes that count the requests they get and how many carried a prefill's params
(``GET /stats``): a target whose decodes got no params did no PD at all, and the bench says so.

Targets, each fed OpenAI ``/v1/completions`` bodies (a shared system text and a question new to
every request, ``max_tokens`` 1, not streamed) by a closed-loop client at each concurrency:

- ``direct``: the client posts straight to a decode (the floor: no prefill, no router);
- ``kvatlas``: ``kvatlas router serve --pd-protocol vllm`` with the static workers, kv_aware;
- ``kvatlas-rr``: the same with round robin on both sides (the proxy's own choice);
- ``vllm-proxy``: vLLM 0.33's ``toy_proxy_server.py`` (fetched unchanged by
  ``tests/peers/vllm_proxy.py``; needs fastapi, httpx, uvicorn), which round robins both sides.

Reported: requests/s, p50/p99, latency added over the floor, the router process's CPU per
request, and requests/s of each kvatlas target over the proxy's (goal >= 1.0x).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from _router_load import PROMPT, closed_loop, post_until_ok, proc_cpu, serve_apps, start, stop

ROOT = Path(__file__).resolve().parents[1]
BODIES = 2000
"""Distinct request bodies, cycled through (every target gets the same sequence)."""


def completion_bodies(n: int = BODIES, model: str = "tiny") -> list[bytes]:
    """``n`` ``/v1/completions`` bodies: the shared system text, then a question of their own."""
    rng = random.Random(7)
    words = ["cache", "prefix", "decode", "router", "token", "latency", "block", "index", "why",
             "how", "does", "the", "of", "when", "NIXL", "pull", "push", "engine"]
    return [json.dumps({"model": model, "max_tokens": 1,
                        "prompt": f"{PROMPT}#{i}: "
                                  + " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
                                  + "?"}).encode()
            for i in range(n)]


# --- stub workers (their own process) ------------------------------------------------------------

def serve_stubs(prefill_ports: list[int], decode_ports: list[int]) -> None:
    """Serve the vLLM-protocol stub prefills and decodes until interrupted."""
    from aiohttp import web

    from tests.vllm_stub import producer_params  # the repo root is on sys.path

    def completion(rid: str, params: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "model": "tiny",
                "choices": [{"index": 0, "text": "o", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
                "kv_transfer_params": params}

    def prefill_app(port: int) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            body = json.loads(await request.read())
            rid = f"cmpl-{request.headers.get('X-Request-Id', secrets.token_hex(8))}"
            asked = body.get("kv_transfer_params") or {}
            params = None
            if asked.get("do_remote_decode"):  # vLLM's pull answer, block ids made up
                params = producer_params(mode="pull", engine_id=f"stub-{port}", request_id=rid,
                                         host="127.0.0.1", port=port + 1, tp_size=1,
                                         block_ids=[1, 2, 3, 4], n_tokens=64)
            return web.json_response(completion(f"{rid}-{secrets.token_hex(4)}", params))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", handle)
        return app

    def decode_app() -> web.Application:
        stats = {"requests": 0, "with_params": 0}

        async def handle(request: web.Request) -> web.Response:
            body = json.loads(await request.read())
            stats["requests"] += 1
            params = body.get("kv_transfer_params") or {}
            if params.get("do_remote_prefill") and params.get("remote_block_ids"):
                stats["with_params"] += 1
            rid = f"cmpl-{request.headers.get('X-Request-Id', secrets.token_hex(8))}"
            return web.json_response(completion(f"{rid}-{secrets.token_hex(4)}", None))

        async def get_stats(_: web.Request) -> web.Response:
            return web.json_response(stats)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/stats", get_stats)
        return app

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "tiny", "object": "model", "root": "tiny", "max_model_len": 4096}]})

    apps = [(p, prefill_app(p)) for p in prefill_ports] + [(p, decode_app())
                                                           for p in decode_ports]
    for _, app in apps:
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
    serve_apps(apps)


# --- the bench -------------------------------------------------------------------------------------

def proxy_missing() -> str | None:
    for name in ("fastapi", "httpx", "uvicorn"):
        if importlib.util.find_spec(name) is None:
            return f"{name} not installed (pip install fastapi httpx uvicorn)"
    return None


def decode_stats(decodes: list[str]) -> dict[str, int]:
    """Requests the decodes got, and how many carried a prefill's params, summed."""
    import urllib.request
    out = {"requests": 0, "with_params": 0}
    for url in decodes:
        with urllib.request.urlopen(f"{url}/stats", timeout=5) as resp:
            got = json.loads(resp.read())
        for k in out:
            out[k] += got[k]
    return out


def target_commands(prefills: list[str], decodes: list[str], ports: dict[str, int],
                    proxy: Path | None) -> dict[str, list[str]]:
    """The command line of each routing target (``direct`` has none)."""
    py = sys.executable
    pf = [a for u in prefills for a in ("--prefill", u, "none")]
    dc = [a for u in decodes for a in ("--decode", u)]
    base = [py, "-m", "kvatlas", "router", "serve", "--pd-protocol", "vllm", *pf, *dc,
            "--tokenizer", "byte"]
    cmds = {"kvatlas": [*base, "--port", str(ports["kvatlas"])],
            "kvatlas-rr": [*base, "--port", str(ports["kvatlas-rr"]), "--prefill-policy",
                           "round_robin", "--decode-policy", "round_robin"]}
    if proxy is not None:
        hosts = ["127.0.0.1"] * len(prefills)
        cmds["vllm-proxy"] = [
            py, str(proxy), "--host", "127.0.0.1", "--port", str(ports["vllm-proxy"]),
            "--prefiller-hosts", *hosts, "--prefiller-ports",
            *(u.rsplit(":", 1)[1] for u in prefills),
            "--decoder-hosts", *(["127.0.0.1"] * len(decodes)), "--decoder-ports",
            *(u.rsplit(":", 1)[1] for u in decodes)]
    return cmds


async def run(args: argparse.Namespace, logdir: Path) -> dict[str, Any]:
    """Every target at every concurrency, rounds interleaved; the median round of each."""
    from kvatlas.etcd_proc import free_port
    ports = [free_port() for _ in range(4)]
    prefills = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    decodes = [f"http://127.0.0.1:{p}" for p in ports[2:]]
    stubs = subprocess.Popen([sys.executable, __file__, "--serve", ",".join(map(str, ports[:2])),
                              ",".join(map(str, ports[2:]))], stdout=subprocess.PIPE,
                             start_new_session=True)
    assert stubs.stdout is not None and stubs.stdout.readline().strip() == b"ready"
    results: dict[str, Any] = {"protocol": "vllm-pull", "bodies": "/v1/completions, not streamed",
                               "prefills": len(prefills), "decodes": len(decodes), "runs": {}}
    missing = proxy_missing()
    proxy = None
    if missing is None:
        try:
            from tests.peers.vllm_proxy import fetch  # the repo root is on sys.path
            proxy = fetch()
        except RuntimeError as exc:
            missing = str(exc)
    results["vllm_proxy"] = missing or "ok"
    names = ("kvatlas", "kvatlas-rr", "vllm-proxy")
    ports = {n: free_port() for n in names}
    cmds = target_commands(prefills, decodes, ports, proxy)
    procs = {name: start(cmd, logdir / f"{name}.log") for name, cmd in cmds.items()}
    targets = {"direct": decodes[0],
               **{name: f"http://127.0.0.1:{ports[name]}" for name in cmds}}
    bodies = completion_bodies()
    try:
        for name, url in list(targets.items()):
            if not await post_until_ok(url, bodies[0]):
                results["runs"][name] = {"error": f"not ready; see {logdir}/{name}.log"}
                del targets[name]
        for conc in args.concurrency:
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for _ in range(args.rounds):
                for name, url in targets.items():
                    proc = procs.get(name)
                    cpu0 = proc_cpu(proc.pid) if proc else 0.0
                    seen0 = decode_stats(decodes)
                    r = await closed_loop(f"{url}/v1/completions", conc, args.duration, bodies)
                    seen = decode_stats(decodes)
                    if proc is not None:
                        r["router_cpu_us_per_req"] = (1e6 * (proc_cpu(proc.pid) - cpu0)
                                                      / max(1, r["requests"]))
                    got = seen["requests"] - seen0["requests"]
                    # share of the decode requests that carried a prefill's kv_transfer_params
                    r["pd_share"] = (seen["with_params"] - seen0["with_params"]) / max(1, got)
                    rounds[name].append(r)
            for name, per in rounds.items():
                per.sort(key=lambda x: x["rps"])
                r = dict(per[len(per) // 2])
                r["rounds_rps"] = [round(x["rps"]) for x in per]
                results["runs"].setdefault(name, {})[str(conc)] = r
                print(f"  {name:11s} c={conc:3d}: {r['rps']:7.0f} req/s (rounds "
                      f"{r['rounds_rps']})  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  "
                      f"errors {r['errors']}  PD {r['pd_share']:.2f}", flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
        stop(stubs)
    results["ratios"] = ratios(results["runs"])
    return results


def ratios(runs: dict[str, Any]) -> dict[str, dict[str, float]]:
    """requests/s of each kvatlas target over the proxy's, per concurrency (goal >= 1.0)."""
    proxy = runs.get("vllm-proxy", {})
    out: dict[str, dict[str, float]] = {}
    for name, per in runs.items():
        if not name.startswith("kvatlas") or "error" in per or "error" in proxy:
            continue
        for conc, r in per.items():
            if conc in proxy and proxy[conc]["rps"]:
                out.setdefault(name, {})[conc] = round(r["rps"] / proxy[conc]["rps"], 2)
    return out


def print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    runs = res["runs"]
    direct = runs.get("direct", {})
    table = Table(title="vLLM PD (pull) routing vs direct-to-decode and vLLM's toy proxy "
                        "(/v1/completions)")
    for col in ("target", "conc", "req/s", "p50 ms", "p99 ms", "+p50 ms", "+p99 ms",
                "router CPU us/req", "PD share", "vs proxy req/s"):
        table.add_column(col, justify="right")
    for name, per in runs.items():
        if "error" in per:
            table.add_row(name, "-", per["error"], *[""] * 7)
            continue
        for conc, r in per.items():
            base = direct.get(conc) if name != "direct" else None
            cpu = r.get("router_cpu_us_per_req")
            ratio = res.get("ratios", {}).get(name, {}).get(conc)
            table.add_row(name, conc, f"{r['rps']:.0f}", f"{r['p50_ms']:.2f}",
                          f"{r['p99_ms']:.2f}",
                          f"{r['p50_ms'] - base['p50_ms']:.2f}" if base else "",
                          f"{r['p99_ms'] - base['p99_ms']:.2f}" if base else "",
                          f"{cpu:.0f}" if cpu else "", f"{r['pd_share']:.2f}",
                          f"{ratio:.2f}x" if ratio else "")
    Console(width=150).print(table)
    if res.get("vllm_proxy") != "ok":
        print(f"vllm-proxy: {res['vllm_proxy']}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.vllm_stub
        serve_stubs([int(p) for p in sys.argv[2].split(",")],
                    [int(p) for p in sys.argv[3].split(",")])
