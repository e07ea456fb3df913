"""KV transfer benchmark over ZMQ between two processes, against raw loopback TCP (issue #5).

  .venv/bin/python bench/transfer.py            # 1k, 4k, 16k tokens (needs ~6 GiB of RAM)
  .venv/bin/python bench/transfer.py --quick    # 1k and 4k tokens, fewer repeats

Geometry of the ``bench`` model: 32 layers, 8 KV heads, head_dim 128, bf16, page_size 16, so one
token is 128 KiB of K+V and 16k tokens are 2 GiB. This process is the decode rank (a
``ZmqReceiver`` writing into its own pool); a child process is the prefill rank (a ``ZmqSender``
over its pool). For every size, each repeat first moves the same byte count over a plain TCP socket
between the same two processes (``sendall`` from the prefill pool, ``recv_into`` the decode pool:
the loopback limit with no protocol and no extra copy), then the same pages through the transfer
layer (request, checksums on both sides, validation, copy into the pool); one untimed transfer per
size comes first. The ratio compares medians; the goal is >= 0.8. Both processes call
``transfer.tuning.tune_host_allocator()`` (heap thresholds and one malloc arena, so ZMQ's received
frames reuse mapped memory) before starting any thread, unless ``--no-tune``; untuned, every
transfer re-faults its frame memory and the ratio drops to ~0.55-0.65. Then p50/p99 latency of a
16-token transfer (one page). After each size the decode pool is hashed and compared with the
prefill's hash of the pages sent.

Every repeat also moves the same pages through a second sender/receiver pair that shares a
transfer key (``KVATLAS_TRANSFER_KEY``; generated for the run and passed to the child through its
environment): every message MAC'd (Poly1305, see ``transfer/auth.py``), so the table shows MAC
off, MAC on and raw TCP side by side.

Writes bench/results/transfer.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import xxhash  # noqa: E402
from _results import write_result

from transfer import KVLayout, TensorPageSource, TransferConfig  # noqa: E402
from transfer.backends.zmq_backend import ZmqReceiver, ZmqSender  # noqa: E402
from transfer.base import TRANSFER_KEY_ENV  # noqa: E402
from transfer.layout import tensor_bytes  # noqa: E402
from transfer.tuning import tune_host_allocator  # noqa: E402

GEOMETRY = dict(num_layers=32, num_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
LAYOUT = KVLayout.for_tp(**GEOMETRY)
TOKEN_BYTES = LAYOUT.page_bytes() // LAYOUT.page_size


def pool_hash(pool: torch.Tensor, pages: int) -> str:
    h = xxhash.xxh3_64()
    for layer in range(pool.shape[0]):
        for kv in (0, 1):
            h.update(tensor_bytes(pool[layer, kv, :pages].contiguous()))
    return h.hexdigest()


# ---- prefill side (child process) ---------------------------------------------------------
async def prefill(pages: int, chunk_bytes: int, tune: bool) -> None:
    if tune:
        tune_host_allocator()
    pool = torch.empty(LAYOUT.pool_shape(pages), dtype=torch.bfloat16)
    pool.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(7))
    flat = tensor_bytes(pool)
    senders = {}
    for kind, key in (("zmq", None), ("mac", os.environ[TRANSFER_KEY_ENV])):
        senders[kind] = ZmqSender(TransferConfig(chunk_bytes=chunk_bytes, key=key), LAYOUT,
                                  TensorPageSource(pool, LAYOUT))
        await senders[kind].start()
    raw = socket.create_server(("127.0.0.1", 0))
    print(f"PORTS {senders['zmq'].port} {senders['mac'].port} {raw.getsockname()[1]}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            break
        if line[0] == "raw":
            print("ready", flush=True)
            conn, _ = raw.accept()
            with conn:
                conn.sendall(flat[:int(line[1])])
        elif line[0] in senders:
            sender, room, n = senders[line[0]], int(line[1]), int(line[2])
            sender.create(room)
            print("ready", flush=True)
            await sender.send(room, list(range(n)), first_token=1, cached_tokens=0)
            print("sent", flush=True)
        elif line[0] == "hash":
            print(pool_hash(pool, int(line[1])), flush=True)
    raw.close()
    for sender in senders.values():
        await sender.close()


# ---- decode side (this process) -----------------------------------------------------------
class Child:
    def __init__(self, pages: int, chunk_bytes: int, tune: bool, key: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "prefill", "--pages",
                                      str(pages), "--chunk-mib", str(chunk_bytes >> 20),
                                      *([] if tune else ["--no-tune"])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, TRANSFER_KEY_ENV: key})
        _, zport, mport, rport = self.read().split()
        self.endpoints = {"zmq": f"tcp://127.0.0.1:{zport}", "mac": f"tcp://127.0.0.1:{mport}"}
        self.raw_port = int(rport)

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the prefill process exited")
        return line.strip()

    def cmd(self, *words: Any) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()


def raw_tcp(child: Child, into: memoryview, nbytes: int) -> float:
    child.cmd("raw", nbytes)
    assert child.read() == "ready"
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", child.raw_port)) as s:
        got = 0
        while got < nbytes:
            n = s.recv_into(into[got:nbytes])
            if n == 0:
                raise RuntimeError("raw TCP peer closed early")
            got += n
    return time.perf_counter() - t0


async def zmq_once(child: Child, rx: ZmqReceiver, room: int, pages: int,
                   kind: str = "zmq") -> float:
    child.cmd(kind, room, pages)
    assert child.read() == "ready"
    t0 = time.perf_counter()
    await rx.receive(room, [child.endpoints[kind]], list(range(pages)))
    dt = time.perf_counter() - t0
    assert child.read() == "sent"
    return dt


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


async def decode(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) for x in args.tokens.split(",")]
    if args.quick:
        sizes = [t for t in sizes if t <= 4096]
    max_pages = max(sizes) // LAYOUT.page_size
    chunk_bytes = args.chunk_mib << 20
    tuned = not args.no_tune and tune_host_allocator()
    key = secrets.token_hex(32)
    child = Child(max_pages, chunk_bytes, tuned, key)
    dst = torch.zeros(LAYOUT.pool_shape(max_pages), dtype=torch.bfloat16)
    dst_bytes = tensor_bytes(dst)
    rxs = {kind: ZmqReceiver(TransferConfig(chunk_bytes=chunk_bytes, key=k), LAYOUT, dst)
           for kind, k in (("zmq", None), ("mac", key))}
    room = 1
    rows = []
    try:
        for kind, rx in rxs.items():  # connect + register + warm up
            await zmq_once(child, rx, room, 1, kind)
            room += 1
        for tokens in sizes:
            pages, nbytes = tokens // LAYOUT.page_size, tokens * TOKEN_BYTES
            raw_s: list[float] = []
            times: dict[str, list[float]] = {kind: [] for kind in rxs}
            ok = True
            for kind, rx in rxs.items():  # untimed: grows the heaps to this size once
                await zmq_once(child, rx, room, pages, kind)
                room += 1
            for _ in range(args.repeats):
                raw_s.append(raw_tcp(child, dst_bytes, nbytes))
                for kind, rx in rxs.items():
                    dst.zero_()
                    times[kind].append(await zmq_once(child, rx, room, pages, kind))
                    room += 1
                    child.cmd("hash", pages)
                    ok = ok and child.read() == pool_hash(dst, pages)
            raw_med = statistics.median(raw_s)
            zmq_med, mac_med = (statistics.median(times[k]) for k in ("zmq", "mac"))
            rows.append({"tokens": tokens, "bytes": nbytes, "repeats": args.repeats,
                         "zmq_ms": zmq_med * 1e3, "zmq_gbps": nbytes / zmq_med / 1e9,
                         "zmq_best_ms": min(times["zmq"]) * 1e3,
                         "mac_ms": mac_med * 1e3, "mac_gbps": nbytes / mac_med / 1e9,
                         "raw_tcp_ms": raw_med * 1e3, "raw_tcp_gbps": nbytes / raw_med / 1e9,
                         "ratio": raw_med / zmq_med, "mac_ratio": raw_med / mac_med,
                         "mac_vs_off": zmq_med / mac_med, "verified": ok,
                         "zmq_all_ms": [round(x * 1e3, 2) for x in times["zmq"]],
                         "mac_all_ms": [round(x * 1e3, 2) for x in times["mac"]],
                         "raw_tcp_all_ms": [round(x * 1e3, 2) for x in raw_s]})
        lat: dict[str, list[float]] = {kind: [] for kind in rxs}
        lat_raw = []
        small_bytes = LAYOUT.page_size * TOKEN_BYTES
        for _ in range(args.latency_iters):
            for kind, rx in rxs.items():
                lat[kind].append(await zmq_once(child, rx, room, 1, kind))
                room += 1
            lat_raw.append(raw_tcp(child, dst_bytes, small_bytes))
        latency = {"tokens": LAYOUT.page_size, "bytes": small_bytes, "iters": args.latency_iters,
                   "zmq_p50_ms": pct(lat["zmq"], 0.5) * 1e3,
                   "zmq_p99_ms": pct(lat["zmq"], 0.99) * 1e3,
                   "mac_p50_ms": pct(lat["mac"], 0.5) * 1e3,
                   "mac_p99_ms": pct(lat["mac"], 0.99) * 1e3,
                   "raw_tcp_p50_ms": pct(lat_raw, 0.5) * 1e3}
    finally:
        child.cmd("quit")
        child.proc.wait(30)
        for rx in rxs.values():
            await rx.close()
    return {"geometry": {**GEOMETRY, "token_bytes": TOKEN_BYTES}, "chunk_bytes": chunk_bytes,
            "allocator_tuned": tuned,
            "sizes": rows, "latency": latency, "quick": args.quick,
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                     "torch": torch.__version__}}


def show(result: dict[str, Any]) -> None:
    print(f"\nKV transfer, two processes, loopback (bf16, {result['geometry']['token_bytes'] >> 10} "
          f"KiB/token, chunks of {result['chunk_bytes'] >> 20} MiB, allocator tuned: "
          f"{result['allocator_tuned']}; GB = 1e9 bytes; medians)")
    print(f"{'tokens':>7} {'MiB':>5} {'MAC off GB/s':>12} {'MAC on GB/s':>11} {'tcp GB/s':>9} "
          f"{'off/tcp':>7} {'on/tcp':>6} {'on/off':>6} {'verified':>8}")
    for r in result["sizes"]:
        print(f"{r['tokens']:>7} {r['bytes'] / 2**20:>5.0f} {r['zmq_gbps']:>12.2f} "
              f"{r['mac_gbps']:>11.2f} {r['raw_tcp_gbps']:>9.2f} {r['ratio']:>7.2f} "
              f"{r['mac_ratio']:>6.2f} {r['mac_vs_off']:>6.2f} {str(r['verified']):>8}")
    lat = result["latency"]
    print(f"\n{lat['tokens']}-token transfer ({lat['bytes'] >> 10} KiB), {lat['iters']} runs: p50 "
          f"MAC off {lat['zmq_p50_ms']:.2f} ms, MAC on {lat['mac_p50_ms']:.2f} ms (p99 "
          f"{lat['zmq_p99_ms']:.2f} / {lat['mac_p99_ms']:.2f}); raw TCP p50 "
          f"{lat['raw_tcp_p50_ms']:.2f} ms (ratio goal >= 0.8 applies to the throughput rows)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only 1k and 4k tokens, fewer repeats")
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--latency-iters", type=int, default=None)
    ap.add_argument("--chunk-mib", type=int, default=TransferConfig().chunk_bytes >> 20)
    ap.add_argument("--no-tune", action="store_true",
                    help="leave glibc malloc as it is (see transfer/tuning.py)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "transfer.json"))
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "prefill":
        asyncio.run(prefill(args.pages, args.chunk_mib << 20, not args.no_tune))
        return 0
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.latency_iters = args.latency_iters or (50 if args.quick else 200)
    result = asyncio.run(decode(args))
    show(result)
    write_result(args.out, result)
    return 0 if all(r["verified"] for r in result["sizes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
