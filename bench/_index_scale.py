"""Block changes per second through one etcd: several writer processes churning at once.

Used by ``bench/index.py`` (part ``scale``); also runnable alone:

    .venv/bin/python bench/_index_scale.py --writers 4 --rate 100000 --seconds 20

Each writer process is one instance's ``BlockWriter`` fed by an LRU prefix cache (32-block chains
stored, the oldest blocks evicted once the cache is full: as many removals as stores), offered
``--rate`` changes/s. Meanwhile ``kvatlas index stats --sample`` in a process of its own watches
every block write and reports the write-to-watch lag, and etcd's db size is sampled. The result:
changes/s made and written by all writers together, etcd ops, lag p50/p99, db size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from index.etcd import EtcdClient, EtcdSettings  # noqa: E402
from index.keys import KeyLayout  # noqa: E402
from index.lease import LeaseSession  # noqa: E402
from index.writer import BlockWriter, BlockWriterConfig  # noqa: E402

MODEL = "bench/model"
MB = 1024 * 1024


class ChurnCache:
    """An engine's prefix cache, as the block writer sees it: each ``step`` stores one 32-block
    chain and evicts as many blocks past ``capacity`` (engines report only blocks they newly
    store). Oldest first (an LRU of stores: whole chains go), or with ``scatter`` blocks drawn at
    random, each most likely from another chain: the worst case for segments, one rewritten per
    evicted block."""

    def __init__(self, capacity: int, rng: random.Random, scatter: bool = False) -> None:
        self.capacity, self.rng, self.scatter = capacity, rng, scatter
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.pool: list[int] = []
        """With ``scatter``: the held blocks, for an O(1) random eviction (swap-remove)."""

    def step(self, writer: BlockWriter) -> int:
        """Store a chain, evict; the changes made."""
        rng = self.rng
        chunk = [rng.getrandbits(64) for _ in range(32)]
        writer.add(None, chunk)
        evict = []
        if self.scatter:
            pool = self.pool
            pool.extend(chunk)
            while len(pool) > self.capacity:
                i = rng.randrange(len(pool) - len(chunk))
                pool[i], pool[-1] = pool[-1], pool[i]
                evict.append(pool.pop())
        else:
            lru = self.lru
            lru.update(dict.fromkeys(chunk))
            while len(lru) > self.capacity:
                evict.append(lru.popitem(last=False)[0])
        writer.remove(evict)
        return len(chunk) + len(evict)


async def writer_main(endpoint: str, prefix: str, instance: str, rate: float, seconds: float,
                      capacity: int, seed: int, scatter: bool = False) -> dict[str, Any]:
    client = EtcdClient(EtcdSettings.from_text(endpoint))
    await client.connect()
    session = LeaseSession(client, 30)
    lease_task = asyncio.create_task(session.run())
    await session.wait_lease()
    writer = BlockWriter(session, KeyLayout(prefix), MODEL, instance, BlockWriterConfig())
    writer.start()
    await writer.wait_synced(30)
    cache = ChurnCache(capacity, random.Random(seed), scatter)
    made = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        # Chunks of at most 4,096 changes, then yield: the writer must get the loop.
        tick = made + 4096
        while made < min(tick, rate * (time.perf_counter() - t0)):
            made += cache.step(writer)
        await asyncio.sleep(0.002)
    synced = await writer.wait_synced(60)
    dt = time.perf_counter() - t0
    out = {"instance": instance, "changes": writer.changes, "seconds": dt, "synced": synced,
           "etcd_ops": writer.segments_written + writer.deletes_written, "txns": writer.txns,
           "blocks": len(writer), "segments": writer.segments, "resyncs": writer.resyncs}
    await writer.close()
    lease_task.cancel()
    await session.revoke()
    await client.close()
    return out


def run(endpoint: str, writers: int, rate: float, seconds: float, capacity: int,
        prefix: str = "/bench-scale", scatter: bool = False) -> dict[str, Any]:
    """``writers`` processes, each offered ``rate`` changes/s; the totals and the lag."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp = Path(tempfile.mkdtemp(prefix="kvatlas-scale-"))
    procs = []
    for i in range(writers):
        out = tmp / f"w{i}.json"
        procs.append((out, subprocess.Popen(
            [sys.executable, __file__, "worker", "--etcd", endpoint, "--prefix", prefix,
             "--instance", f"w{i}", "--rate", str(rate), "--seconds", str(seconds),
             "--capacity", str(capacity), "--seed", str(i), "--out", str(out),
             *(["--scatter"] if scatter else [])],
            cwd=ROOT, env=env)))
    # The lag is sampled in the middle of the run, from a process of its own (a router's view).
    time.sleep(min(3.0, seconds / 3))
    sample = max(1.0, seconds / 3)
    stats = subprocess.run(
        [sys.executable, "-m", "kvatlas", "index", "stats", "--json", "--sample", f"{sample:g}",
         "--etcd", endpoint, "--etcd-prefix", prefix],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 120)
    db = asyncio.run(_db_size(endpoint))
    for _, p in procs:
        p.wait(timeout=seconds + 180)
    rows = [json.loads(out.read_text()) for out, _ in procs]
    lags: list[dict[str, Any]] = []
    if stats.returncode == 0:
        lags = [r["mirror_lag_s"] for r in json.loads(stats.stdout)["instances"]
                if r.get("mirror_lag_s")]
    wall = max(r["seconds"] for r in rows)
    changes = sum(r["changes"] for r in rows)
    ops = sum(r["etcd_ops"] for r in rows)
    return {
        "writers": writers, "scatter": scatter, "offered_changes_s": rate * writers, "seconds": wall,
        "changes": changes, "changes_s": changes / wall, "etcd_ops": ops,
        "etcd_ops_s": ops / wall, "changes_per_op": changes / max(1, ops),
        "all_synced": all(r["synced"] for r in rows),
        "resyncs": sum(r["resyncs"] for r in rows),
        # The worst writer's: lag is per instance.
        "lag_p50_ms": 1e3 * max(lag["p50"] for lag in lags) if lags else None,
        "lag_p99_ms": 1e3 * max(lag["p99"] for lag in lags) if lags else None,
        "lag_samples": sum(lag["samples"] for lag in lags),
        "db_mb": db, "per_writer": rows,
        "stats_error": None if stats.returncode == 0 else stats.stderr[-500:],
    }


async def _db_size(endpoint: str) -> float:
    async with EtcdClient(EtcdSettings.from_text(endpoint)) as client:
        return (await client.status()).db_size / MB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="run", choices=("run", "worker"))
    p.add_argument("--etcd", default=None, help="etcd endpoint (default: start one)")
    p.add_argument("--prefix", default="/bench-scale")
    p.add_argument("--instance", default="w0")
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--rate", type=float, default=100_000.0, help="changes/s offered per writer")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--capacity", type=int, default=20_000, help="each writer's LRU, in blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--scatter", action="store_true",
                   help="evict random blocks, not the oldest chains (segments' worst case)")
    args = p.parse_args()
    if args.mode == "worker":
        res = asyncio.run(writer_main(args.etcd, args.prefix, args.instance, args.rate,
                                      args.seconds, args.capacity, args.seed, args.scatter))
        Path(args.out).write_text(json.dumps(res))
        return 0
    from kvatlas.etcd_proc import EtcdCluster
    cluster = None
    endpoint = args.etcd
    if endpoint is None:
        cluster = EtcdCluster(1).start()
        endpoint = cluster.endpoints
    try:
        res = run(endpoint, args.writers, args.rate, args.seconds, args.capacity, args.prefix,
                  args.scatter)
    finally:
        if cluster is not None:
            cluster.stop()
    print(json.dumps({k: v for k, v in res.items() if k != "per_writer"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
