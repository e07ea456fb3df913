"""CUDA IPC KV transfer between two processes on one GPU host, against torch's own device copy.

  .venv/bin/python bench/device_transfer.py             # 1k, 4k, 16k tokens; < 3 minutes
  .venv/bin/python bench/device_transfer.py --quick     # 1k and 4k tokens
  .venv/bin/python bench/device_transfer.py --dst-device cuda:1   # decode pool on another GPU

Same ``bench`` geometry as bench/transfer.py (32 layers, 8 KV heads, head_dim 128, bf16,
page_size 16: 128 KiB per token). This process is the decode rank (``CudaIpcReceiver``, pool on
``--dst-device``); a child process is the prefill rank (``CudaIpcSender`` in mode ``ipc``, pool on
``--src-device``). A transfer is timed from the decode's request to its pages written (device
checksums on both sides included). The limit, measured in the same run: ``dst.copy_(src)`` of the
same bytes between the same devices inside one process, synchronized. Then the pinned-host fallback
(mode ``staged``) for the same sizes, for comparison. On a host without CUDA it prints one
"no CUDA" line and exits with status 2. Writes bench/results/device_transfer.json.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from _results import write_result

from transfer import KVLayout, TensorPageSource, TransferConfig  # noqa: E402

GEOMETRY = dict(num_layers=32, num_heads=8, head_dim=128, page_size=16, dtype="bfloat16")
LAYOUT = KVLayout.for_tp(**GEOMETRY)
TOKEN_BYTES = LAYOUT.page_bytes() // LAYOUT.page_size
DEADLINE_S = 170


def bit_sum(pool: torch.Tensor, pages: int) -> int:
    return int(pool[:, :, :pages].view(torch.int16).sum(dtype=torch.int64).item())


async def prefill(pages: int, device: str, mode: str) -> None:
    from transfer.backends.cuda_ipc import CudaIpcSender

    pool = torch.empty(LAYOUT.pool_shape(pages), dtype=torch.bfloat16, device=device)
    pool.normal_()
    sender = CudaIpcSender(TransferConfig(), LAYOUT, TensorPageSource(pool, LAYOUT), mode=mode,
                           device=device)
    await sender.start()
    print(f"PORT {sender.port}", flush=True)
    loop = asyncio.get_running_loop()
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not line or line[0] == "quit":
            break
        if line[0] == "zmq":
            room, n = int(line[1]), int(line[2])
            sender.create(room)
            print("ready", flush=True)
            await sender.send(room, list(range(n)), first_token=1, cached_tokens=0)
            choice = next(iter(sender.choices.values()))
            print(f"sent {choice.mode}", flush=True)
        elif line[0] == "sum":  # exact reference sum of the first n pages' bits, to verify
            print(bit_sum(pool, int(line[1])), flush=True)
    await sender.close()


class Child:
    def __init__(self, pages: int, device: str, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "prefill", "--pages",
                                      str(pages), "--src-device", device, "--mode", mode],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.endpoint = f"tcp://127.0.0.1:{self.read().split()[1]}"

    def read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the prefill process exited")
        return line.strip()

    def cmd(self, *words: Any) -> None:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.cmd("quit")
        self.proc.wait(30)


async def run_mode(mode: str, sizes: list[int], args: argparse.Namespace,
                   dst: torch.Tensor) -> list[dict[str, Any]]:
    from transfer.backends.cuda_ipc import CudaIpcReceiver

    child = Child(max(sizes) // LAYOUT.page_size, args.src_device, mode)
    rx = CudaIpcReceiver(TransferConfig(), LAYOUT, dst)
    rows, room = [], 1
    try:
        async def once(pages: int) -> tuple[float, str]:
            nonlocal room
            child.cmd("zmq", room, pages)
            assert child.read() == "ready"
            t0 = time.perf_counter()
            await rx.receive(room, [child.endpoint], list(range(pages)))
            dt = time.perf_counter() - t0
            room += 1
            return dt, child.read().split()[1]

        await once(1)  # connect, register, open the IPC handle of the source pool
        for tokens in sizes:
            pages = tokens // LAYOUT.page_size
            times, used = [], ""
            for _ in range(args.repeats):
                dst[:, :, :pages].zero_()
                dt, used = await once(pages)
                times.append(dt)
            child.cmd("sum", pages)
            ref = int(child.read())
            got = bit_sum(dst, pages)
            med = statistics.median(times)
            rows.append({"mode": used, "tokens": tokens, "bytes": tokens * TOKEN_BYTES,
                         "ms": med * 1e3, "gbps": tokens * TOKEN_BYTES / med / 1e9,
                         "verified": got == ref})
    finally:
        child.close()
        await rx.close()
    return rows


def torch_copy(tokens: int, src_device: str, dst_device: str, repeats: int) -> float:
    n = tokens * TOKEN_BYTES
    src = torch.empty(n, dtype=torch.uint8, device=src_device)
    dst = torch.empty(n, dtype=torch.uint8, device=dst_device)
    dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [1024, 4096] if args.quick else [1024, 4096, 16384]
    dst = torch.zeros(LAYOUT.pool_shape(max(sizes) // LAYOUT.page_size), dtype=torch.bfloat16,
                      device=args.dst_device)
    ipc = await run_mode("ipc", sizes, args, dst)
    staged = await run_mode("staged", sizes, args, dst) if not args.no_staged else []
    for row in ipc + staged:
        limit = torch_copy(row["tokens"], args.src_device, args.dst_device, args.repeats)
        row["torch_copy_ms"] = limit * 1e3
        row["torch_copy_gbps"] = row["bytes"] / limit / 1e9
        row["ratio"] = row["gbps"] / row["torch_copy_gbps"]
    return {"geometry": {**GEOMETRY, "token_bytes": TOKEN_BYTES}, "src_device": args.src_device,
            "dst_device": args.dst_device, "gpu": torch.cuda.get_device_name(args.dst_device),
            "torch": torch.__version__, "cuda": torch.version.cuda, "rows": ipc + staged,
            "command": " ".join([Path(sys.executable).name, *sys.argv])}


def show(result: dict[str, Any]) -> None:
    print(f"\nKV transfer between two processes, {result['src_device']} -> {result['dst_device']} "
          f"({result['gpu']}), bf16, 128 KiB/token; GB = 1e9 bytes; medians")
    print(f"{'mode':>7} {'tokens':>7} {'MiB':>6} {'ms':>8} {'GB/s':>8} {'torch ms':>9} "
          f"{'torch GB/s':>10} {'ratio':>6} {'ok':>5}")
    for r in result["rows"]:
        print(f"{r['mode']:>7} {r['tokens']:>7} {r['bytes'] / 2**20:>6.0f} {r['ms']:>8.2f} "
              f"{r['gbps']:>8.1f} {r['torch_copy_ms']:>9.2f} {r['torch_copy_gbps']:>10.1f} "
              f"{r['ratio']:>6.2f} {str(r['verified']):>5}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--src-device", default="cuda:0")
    ap.add_argument("--dst-device", default="cuda:0")
    ap.add_argument("--no-staged", action="store_true", help="skip the pinned-host fallback rows")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "device_transfer.json"))
    ap.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    ap.add_argument("--pages", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ipc", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"no CUDA: torch {torch.__version__} (torch.version.cuda={torch.version.cuda}) sees no "
              "GPU; bench/device_transfer.py needs a CUDA host (use bench/transfer.py here)")
        return 2
    if args.role == "prefill":
        asyncio.run(prefill(args.pages, args.src_device, args.mode))
        return 0
    from transfer.backends.cuda_ipc import cuda_ipc_status

    ok, why = cuda_ipc_status()
    if not ok:
        print(f"CUDA IPC unavailable on this host: {why}")
        return 2
    signal.alarm(DEADLINE_S)  # the lead's device slot is short: never run past 3 minutes
    result = asyncio.run(main_async(args))
    show(result)
    write_result(args.out, result)
    return 0 if all(r["verified"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
