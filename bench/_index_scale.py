"""Block changes per second through one etcd: several writer processes churning at once.

Used by ``bench/index.py`` (part ``scale``); also runnable alone:

    .venv/bin/python bench/_index_scale.py --writers 4 --rate 100000 --seconds 20 [--shards 2]

Each writer process is one instance's ``BlockWriter`` fed by an LRU prefix cache (32-block chains
stored, the oldest blocks evicted once the cache is full: as many removals as stores), offered
``--rate`` changes/s. Meanwhile ``kvatlas index stats --sample`` in a process of its own watches
every block write and reports the write-to-watch lag, and etcd's db size is sampled. The result:
changes/s made and written by all writers together, etcd ops, lag p50/p99, db size.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from index.etcd import EtcdClient, EtcdSettings  # noqa: E402
from index.keys import KeyLayout  # noqa: E402
from index.lease import LeaseSession  # noqa: E402
from index.shards import IndexShards  # noqa: E402
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


def writer_ids(shards: IndexShards, writers: int) -> list[str]:
    """``writers`` instance ids that ``shards`` places round the shards evenly (writer i on
    shard i mod N), as rendezvous placement spreads many instances."""
    n, out = shards.count, []
    for k in range(100_000):
        iid = f"w{k}"
        if shards.place(iid) == len(out) % n:
            out.append(iid)
            if len(out) == writers:
                return out
    raise RuntimeError("no instance ids for an even placement")


CGROUP_CPU = Path("/sys/fs/cgroup/cpu")


class CpuCap:
    """Caps processes at a share of one core (a cgroup v1 CFS quota): each etcd then stands
    for an etcd host of its own that a 2-core box's writers can saturate."""

    def __init__(self, name: str, fraction: float) -> None:
        if not 0.01 <= fraction <= 64:
            raise ValueError(f"CPU cap must be within [0.01, 64] cores, got {fraction}")
        self.path = CGROUP_CPU / name
        try:
            self.path.mkdir(exist_ok=True)
            # A 10 ms period (the default is 100 ms): a capped etcd is then held back for at
            # most a few ms at a time, like a slower host, not frozen for tens of ms.
            period = 10_000
            (self.path / "cpu.cfs_quota_us").write_text("-1")
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(int(period * fraction)))
        except OSError as exc:
            raise SystemExit(f"--etcd-cpu needs a writable cgroup v1 cpu controller at "
                             f"{CGROUP_CPU} (root): {exc}") from None

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CGROUP_CPU / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(endpoints: Sequence[str], writers: int, rate: float, seconds: float, capacity: int,
        prefix: str = "/bench-scale", scatter: bool = False,
        etcd_pids: Sequence[int] = ()) -> dict[str, Any]:
    """``writers`` processes, each offered ``rate`` changes/s, their blocks spread over the
    ``endpoints`` (one etcd each: the index shards); the totals and the lag. With
    ``etcd_pids`` (one per endpoint), the CPU each etcd spent meanwhile: what a dedicated etcd
    host would be short of first."""
    cpu0 = [cpu_seconds(p) for p in etcd_pids]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp = Path(tempfile.mkdtemp(prefix="kvatlas-scale-"))
    shards = IndexShards.from_texts(endpoints if len(endpoints) > 1 else [], EtcdSettings())
    procs = []
    for i, iid in enumerate(writer_ids(shards, writers)):
        out = tmp / f"{iid}.json"
        endpoint = endpoints[shards.place(iid)]
        procs.append((out, subprocess.Popen(
            [sys.executable, __file__, "worker", "--etcd", endpoint, "--prefix", prefix,
             "--instance", iid, "--rate", str(rate), "--seconds", str(seconds),
             "--capacity", str(capacity), "--seed", str(i), "--out", str(out),
             *(["--scatter"] if scatter else [])],
            cwd=ROOT, env=env)))
    # The lag is sampled in the middle of the run, from a process of its own (a router's view).
    time.sleep(min(3.0, seconds / 3))
    sample = max(1.0, seconds / 3)
    stats = subprocess.run(
        [sys.executable, "-m", "kvatlas", "index", "stats", "--json", "--sample", f"{sample:g}",
         "--etcd", endpoints[0], "--etcd-prefix", prefix,
         *(["--index-etcd", *endpoints] if len(endpoints) > 1 else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 120)
    db = sum(asyncio.run(_db_size(e)) for e in endpoints)
    for _, p in procs:
        p.wait(timeout=seconds + 180)
    etcd_cpu = [cpu_seconds(p) - c for p, c in zip(etcd_pids, cpu0, strict=True)]
    rows = [json.loads(out.read_text()) for out, _ in procs]
    lags: list[dict[str, Any]] = []
    if stats.returncode == 0:
        lags = [r["mirror_lag_s"] for r in json.loads(stats.stdout)["instances"]
                if r.get("mirror_lag_s")]
    wall = max(r["seconds"] for r in rows)
    changes = sum(r["changes"] for r in rows)
    ops = sum(r["etcd_ops"] for r in rows)
    return {
        "writers": writers, "shards": len(endpoints), "scatter": scatter,
        "offered_changes_s": rate * writers, "seconds": wall,
        "changes": changes, "changes_s": changes / wall, "etcd_ops": ops,
        "etcd_ops_s": ops / wall, "changes_per_op": changes / max(1, ops),
        "all_synced": all(r["synced"] for r in rows),
        "resyncs": sum(r["resyncs"] for r in rows),
        # The worst writer's: lag is per instance.
        "lag_p50_ms": 1e3 * max(lag["p50"] for lag in lags) if lags else None,
        "lag_p99_ms": 1e3 * max(lag["p99"] for lag in lags) if lags else None,
        "lag_samples": sum(lag["samples"] for lag in lags),
        "db_mb": db, "per_writer": rows,
        # Per shard: the share of one core its etcd was busy, and the changes one etcd CPU
        # second carried (the capacity of an etcd with a core to itself).
        "etcd_busy": [c / wall for c in etcd_cpu],
        "changes_per_etcd_cpu_s": changes / sum(etcd_cpu) if sum(etcd_cpu) > 0 else None,
        "stats_error": None if stats.returncode == 0 else stats.stderr[-500:],
    }


async def _db_size(endpoint: str) -> float:
    async with EtcdClient(EtcdSettings.from_text(endpoint)) as client:
        return (await client.status()).db_size / MB


def run_shards(shards: int, writers: int, rate: float, seconds: float, capacity: int,
               scatter: bool = False, etcd_cpu: float | None = None) -> dict[str, Any]:
    """``run`` against ``shards`` etcds started here (each capped at ``etcd_cpu`` cores)."""
    from kvatlas.etcd_proc import EtcdCluster
    clusters: list[EtcdCluster] = []
    caps: list[CpuCap] = []
    try:
        for i in range(shards):
            clusters.append(EtcdCluster(1).start())
            if etcd_cpu is not None:
                caps.append(CpuCap(f"kvatlas-bench-etcd{i}", etcd_cpu))
                caps[-1].add(clusters[-1].members[0].proc.pid)  # type: ignore[union-attr]
        pids = [c.members[0].proc.pid for c in clusters]  # type: ignore[union-attr]
        res = run([c.endpoints for c in clusters], writers, rate, seconds, capacity,
                  scatter=scatter, etcd_pids=pids)
        res["etcd_cpu_cap"] = etcd_cpu
        return res
    finally:
        for c in clusters:
            c.stop()
        for cap in caps:
            cap.remove()


def sustained(shards: int, writers: int, totals: Sequence[float], seconds: float,
              capacity: int, etcd_cpu: float | None, lag_budget_ms: float = 250.0
              ) -> dict[str, Any]:
    """The most block changes/s ``shards`` etcds carry with the mirror lag p99 within budget:
    ``totals`` (offered changes/s, all writers together) tried in increasing order until one
    misses the budget or is not kept up with (made < 95 % of offered)."""
    runs = []
    best = 0.0
    for total in totals:
        r = run_shards(shards, writers, total / writers, seconds, capacity, etcd_cpu=etcd_cpu)
        r.pop("per_writer")
        p99 = r["lag_p99_ms"]
        r["within_budget"] = (p99 is not None and p99 <= lag_budget_ms
                              and r["changes_s"] >= 0.95 * total)
        runs.append(r)
        if not r["within_budget"]:
            break
        best = r["changes_s"]
    return {"shards": shards, "writers": writers, "etcd_cpu_cap": etcd_cpu,
            "lag_budget_ms": lag_budget_ms, "sustained_changes_s": best, "runs": runs}


def shards_part(quick: bool, etcd_cpu: float, capacity: int,
                show: Callable[[str, list[tuple[str, str]]], None]) -> dict[str, Any]:
    """bench/index.py's part ``shards``: the changes/s 1, 2 and 4 index shards sustain within
    the lag budget, each etcd capped at ``etcd_cpu`` cores; then one uncapped run, for what an
    etcd CPU second carries."""
    totals = ([50e3, 100e3, 200e3, 300e3] if quick
              else [25e3, 50e3, 75e3, 100e3, 125e3, 150e3, 200e3, 250e3, 300e3, 400e3, 500e3,
                    600e3])
    seconds = 5.0 if quick else 8.0
    out: dict[str, Any] = {"etcd_cpu_cap": etcd_cpu, "sweeps": []}
    rows = []
    base = None
    for shards in (1, 2, 4):
        r = sustained(shards, 4, totals, seconds, capacity, etcd_cpu)
        out["sweeps"].append(r)
        best = r["sustained_changes_s"]
        if shards == 1:
            base = best
        tried = ", ".join(f"{x['changes_s'] / 1e3:.0f}k@{x['lag_p99_ms'] or 0:.0f}ms"
                          for x in r["runs"])
        rows.append((f"{shards} shard{'s' if shards > 1 else ''} ({shards} etcd x "
                     f"{etcd_cpu:g} core)",
                     f"{best:>9,.0f} changes/s"
                     + (f"  x{best / base:.2f} of 1 shard" if base else "")
                     + f"   (runs, made@lag p99: {tried})"))
    free = run_shards(1, 2, 300e3, seconds, capacity)
    free.pop("per_writer")
    out["uncapped"] = free
    rows.append(("1 etcd, uncapped, 2 writers",
                 f"{free['changes_s']:,.0f} changes/s with etcd {free['etcd_busy'][0]:.2f} "
                 f"core busy: {free['changes_per_etcd_cpu_s']:,.0f} changes per etcd CPU "
                 "second"))
    show(f"block changes/s the index sustains with lag p99 <= 250 ms, over 1 / 2 / 4 etcd "
         f"shards (4 writer processes; each etcd capped at {etcd_cpu:g} core so that etcd, not "
         "this 2-core box's writers, is the limit)", rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", nargs="?", default="run", choices=("run", "worker"))
    p.add_argument("--etcd", default=None, help="a worker's etcd endpoint")
    p.add_argument("--shards", type=int, default=1,
                   help="etcds (started here) the writers' blocks are spread over")
    p.add_argument("--etcd-cpu", type=float, default=None,
                   help="cap each etcd at this many cores (cgroup v1, root): etcd, not the "
                        "writers, is then the limit, as with an etcd host of its own")
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
    res = run_shards(args.shards, args.writers, args.rate, args.seconds, args.capacity,
                     args.scatter, args.etcd_cpu)
    print(json.dumps({k: v for k, v in res.items() if k != "per_writer"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
