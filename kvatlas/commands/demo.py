"""``kvatlas demo``: the README's main command.

It starts embedded etcd and one prefill instance's bootstrap server as local processes, registers
a demo topology the way SGLang prefill ranks do (``PUT /route`` per rank), then shows what the
cluster sees through etcd (``kvatlas instances``, ``kvatlas bootstrap show``) and what a decode
sees through the bootstrap server (the topology document), and stops everything.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvatlas.cli import CLIError
from kvatlas.etcd_proc import EtcdCluster, free_port


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start embedded etcd + a bootstrap server, register ranks, show them")
    p.add_argument("--dp", type=int, default=2, help="demo data-parallel size")
    p.add_argument("--tp", type=int, default=2, help="demo tensor-parallel size")
    p.add_argument("--keep", action="store_true", help="keep running until Ctrl-C")
    p.set_defaults(func=run)


def _http(method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CLIError(f"bootstrap server exited with code {proc.returncode}")
        try:
            if _http("GET", url, timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise CLIError(f"bootstrap server did not answer on {url} within {timeout:.0f}s")


def _wait_mirrored(base: str, timeout: float = 10.0) -> None:
    """The etcd mirror is asynchronous; /metrics says when the server reports it synced."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, text = _http("GET", f"{base}/metrics")
        if 'state="synced"} 1.0' in text:
            return
        time.sleep(0.1)
    print(f"(etcd mirror not synced after {timeout:.0f}s; etcd may lag)")


def _kvatlas(*args: str) -> None:
    print(f"\n$ kvatlas {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "kvatlas", *args], check=False)


def run(args: argparse.Namespace) -> int:
    if args.dp < 1 or args.tp < 1 or args.dp * args.tp > 64:
        raise CLIError("--dp and --tp must be >= 1 with dp*tp <= 64")
    with tempfile.TemporaryDirectory(prefix="kvatlas-demo-") as tmp:
        print("starting embedded etcd ...", flush=True)
        etcd = EtcdCluster(1, base_dir=Path(tmp) / "etcd").start()
        port = free_port()
        log_path = Path(tmp) / "bootstrap.log"
        with open(log_path, "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "kvatlas", "--log-level", "INFO", "bootstrap", "serve",
                 "--host", "127.0.0.1", "--port", str(port), "--instance-id", "prefill-0",
                 "--model", "tiny", "--etcd", etcd.endpoints, "--lease-ttl", "5"],
                stdout=subprocess.DEVNULL, stderr=log,
            )
        try:
            base = f"http://127.0.0.1:{port}"
            try:
                _wait_http(f"{base}/health", server)
            except CLIError as exc:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                raise CLIError(f"{exc}; its log ends with: {' | '.join(tail)}") from None
            print(f"bootstrap server for instance prefill-0 on {base} (etcd {etcd.endpoints})")
            status, text = _http("GET", f"{base}/ready")
            print(f"before registration: GET /ready -> {status} {text.strip()}")
            for dp in range(args.dp):
                for tp in range(args.tp):
                    body = {
                        "attn_tp_size": args.tp, "attn_tp_rank": tp, "attn_cp_size": 1,
                        "attn_cp_rank": 0, "attn_dp_size": args.dp, "attn_dp_rank": dp,
                        "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
                        "rank_ip": "127.0.0.1", "rank_port": 17000 + dp * args.tp + tp,
                        "page_size": 16, "kv_cache_dtype": "bfloat16", "kv_layout": None,
                        "dsv41_spec_layout": None, "load_balance_method": "follow_bootstrap_room",
                        "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
                        "prefill_http_port": 30000, "decode_allocation_policy": "early",
                    }
                    status, text = _http("PUT", f"{base}/route", body)
                    if status != 200:
                        raise CLIError(f"PUT /route for dp={dp} tp={tp} failed: {status} {text}")
            status, text = _http("GET", f"{base}/ready")
            print(f"after {args.dp * args.tp} PUT /route: GET /ready -> {status} {text.strip()}")
            status, text = _http("GET", f"{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                        "&target_tp_rank=-1&target_pp_rank=-1")
            print(f"topology a decode sees (GET /route with -1s): {text}")
            _wait_mirrored(base)
            _kvatlas("instances", "--etcd", etcd.endpoints)
            _kvatlas("bootstrap", "show", "prefill-0", "--etcd", etcd.endpoints)
            if args.keep:
                print("\nrunning; Ctrl-C to stop")
                while server.poll() is None:
                    time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            server.terminate()
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
            etcd.stop()
        print("\nstopped the bootstrap server and etcd")
    return 0
