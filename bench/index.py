"""Benchmark of the etcd block index (issue #3, Performance): one run prints everything.

  .venv/bin/python bench/index.py            # about 10 minutes
  .venv/bin/python bench/index.py --quick    # about 1 minute, smaller sizes

Parts, each with the limit it is compared with, measured in the same run:
1. Write path: blocks/s through ``BlockWriter`` vs raw one-key-per-put throughput of the same
   client against the same etcd (sequential and with as many puts in flight as the writer's
   transactions), and the mirror's watch lag (write time -> applied) at that write rate.
2. Churn: an LRU prefix cache storing and evicting blocks; changes made vs etcd ops written
   (the coalescing gain) and etcd's db size sampled over time, first with the launch settings of
   ``kvatlas.etcd_proc.COMPACTION_ARGS`` and then with periodic auto-compaction, to show what keeps
   the db bounded.
3. Scale: block changes/s through one etcd with 1, 2 and 4 writer processes churning at once
   (``bench/_index_scale.py``), the write-to-watch lag a separate process sees meanwhile, and the
   db size; against the one-key-per-block limit (raw puts, part 1) of the same etcd.
4. Shards: the block changes/s 1, 2 and 4 etcds (``--index-etcd`` shards) sustain with the
   mirror lag p99 within 250 ms, each etcd capped at ``--etcd-cpu`` cores (a cgroup quota) so
   that etcd is the limit, as with etcd hosts of their own; and what one etcd CPU second carries.
5. Lookup: p50/p99 and lookups/s for prompts of 64/256/1024 blocks with 8/64/256 instances and
   1M blocks indexed, measured on ``index.table.BlockTable`` directly: the mirror answers lookups
   with exactly that structure, so the etcd side adds nothing to a lookup. Then memory per indexed
   block (tracemalloc) and how the cost grows with prompt length, instances and blocks indexed.
6. Dynamo (``bench/_index_dynamo.py``): the same workload in ``BlockTable`` and in Dynamo's Rust
   ``RadixTree`` (``ai-dynamo-runtime``, in the bench extras: ``pip install -e '.[bench]'``) at
   8/64/256 workers and 1M blocks, pinned to one CPU: lookup p50/p99 and apply rate of both, with
   the ratios, every lookup answer checked equal; plus our etcd mirror's segment-apply rate and
   memory per block. ``--parts dynamo`` runs it alone (about a minute).

Writes bench/results/index.json.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import _index_scale  # noqa: E402  (bench/ is the script's directory)
from _index_dynamo import dynamo_part  # noqa: E402
from _index_lookup import cpu_parts, show  # noqa: E402

from index.etcd import EtcdClient, EtcdSettings  # noqa: E402
from index.keys import KeyLayout  # noqa: E402
from index.lease import LeaseSession  # noqa: E402
from index.mirror import BlockMirror, BlockMirrorConfig  # noqa: E402
from index.writer import BlockWriter, BlockWriterConfig  # noqa: E402
from kvatlas.etcd_proc import COMPACTION_ARGS, EtcdCluster  # noqa: E402

MODEL = "bench/model"
MB = 1024 * 1024


@contextlib.asynccontextmanager
async def lease_session(client: EtcdClient, ttl: int = 30):  # type: ignore[no-untyped-def]
    session = LeaseSession(client, ttl)
    task = asyncio.create_task(session.run())
    await session.wait_lease()
    try:
        yield session
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await session.revoke()


# --- 1. write path ----------------------------------------------------------------------------


async def raw_puts(client: EtcdClient, layout: KeyLayout, lease: int, n: int,
                   concurrency: int) -> float:
    """Blocks/s writing one key per put (the value a writer would write), ``concurrency`` at once."""
    keys = iter(range(n))
    value = b'{"m":"GPU","p":null,"t":%.4f}' % time.time()

    async def worker() -> None:
        for i in keys:
            # Beside the blocks prefix: a key per block is the limit measured, not a layout.
            await client.put(f"{layout.prefix}/raw/{i:016x}".encode(), value, lease)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return n / (time.perf_counter() - t0)


async def write_path(endpoint: str, n_blocks: int, raw_n: int) -> dict[str, Any]:
    layout = KeyLayout("/bench-write")
    client = EtcdClient(EtcdSettings.from_text(endpoint))
    reader = EtcdClient(EtcdSettings.from_text(endpoint))
    await client.connect()
    await reader.connect()
    cfg = BlockWriterConfig()
    mirror = BlockMirror(reader, layout, MODEL, BlockMirrorConfig(lag_samples=1_000_000))
    mirror.start()
    await mirror.wait_ready()
    out: dict[str, Any] = {"writer_config": vars(cfg)}
    try:
        async with lease_session(client) as session:
            lease = session.lease_id or 0
            out["raw_put_seq_blocks_s"] = await raw_puts(client, layout, lease, raw_n // 4, 1)
            out["raw_put_conc_blocks_s"] = await raw_puts(client, layout, lease, raw_n,
                                                          cfg.max_inflight)
            await client.delete(f"{layout.prefix}/raw/".encode(), prefix=True)
            writer = BlockWriter(session, layout, MODEL, "w0", cfg)
            writer.start()
            await writer.wait_synced(30)
            await mirror.wait_revision(writer.last_revision, 30)
            mirror.reset_lag()
            rng = random.Random(1)
            t0 = time.perf_counter()
            parent = None
            for i in range(0, n_blocks, 32):  # prefix-cache store events of 32 blocks
                chunk = [rng.getrandbits(64) for _ in range(32)]
                writer.add(parent, chunk)
                parent = chunk[-1]
                if i % 1024 == 0:
                    await asyncio.sleep(0)  # let the writer and mirror run, as an engine would
            await writer.wait_synced(300)
            dt = time.perf_counter() - t0
            await mirror.wait_revision(writer.last_revision, 60)
            seen = time.perf_counter() - t0
            lag = mirror.lag_stats()
            out.update({
                "blocks": len(writer), "writer_blocks_s": len(writer) / dt,
                "txns": writer.txns, "segments": writer.segments,
                "ops_per_txn": writer.segments_written / max(1, writer.txns),
                "mirror_visible_blocks_s": len(writer) / seen,
                "mirror_lag_p50_ms": lag["p50"] * 1e3, "mirror_lag_p99_ms": lag["p99"] * 1e3,
                "mirror_lag_samples": lag["samples"],
                "mirror_blocks": len(mirror.table()),
            })
            # Memory of a real mirror loaded from etcd, to check it against the BlockTable figure.
            gc.collect()
            tracemalloc.start()
            loaded = BlockMirror(reader, layout, MODEL)
            await loaded.reload()
            gc.collect()
            used = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            out["mirror_reload_bytes_per_block"] = used / max(1, len(loaded.table()))
            del loaded
            out["ratio_vs_raw_conc"] = out["writer_blocks_s"] / out["raw_put_conc_blocks_s"]
            out["ratio_vs_raw_seq"] = out["writer_blocks_s"] / out["raw_put_seq_blocks_s"]
            await writer.close()
    finally:
        await mirror.close()
        await client.delete(b"/bench-write/", prefix=True)
        await client.close()
        await reader.close()
    return out


# --- 2. churn and etcd hygiene ----------------------------------------------------------------


async def churn(endpoint: str, seconds: float, rate: float, capacity: int,
                sample_every: float = 2.0) -> dict[str, Any]:
    """An LRU prefix cache of ``capacity`` blocks storing 32-block chains at ``rate`` changes/s
    (evicting as many) for ``seconds``; samples etcd's db size while it runs."""
    layout = KeyLayout("/bench-churn")
    client = EtcdClient(EtcdSettings.from_text(endpoint))
    await client.connect()
    samples: list[dict[str, float]] = []
    cache = _index_scale.ChurnCache(capacity, random.Random(2))
    try:
        async with lease_session(client) as session:
            writer = BlockWriter(session, layout, MODEL, "c0", BlockWriterConfig())
            writer.start()
            await writer.wait_synced(30)
            t0 = time.perf_counter()
            next_sample = 0.0
            made = 0
            peak_pending = 0
            while (now := time.perf_counter() - t0) < seconds:
                if now >= next_sample:
                    st = await client.status()
                    samples.append({"t": round(now, 1), "db_mb": st.db_size / MB,
                                    "in_use_mb": st.db_size_in_use / MB,
                                    "revision": st.revision})
                    next_sample += sample_every
                # Offered load: changes follow ``rate``, made at most 4,096 at a time, then the
                # loop yields, so that an offered rate above what this CPU can make does not
                # starve the writer.
                tick = made + 4096
                while made < min(tick, rate * (time.perf_counter() - t0)):
                    made += cache.step(writer)
                peak_pending = max(peak_pending, writer.pending)
                await asyncio.sleep(0.002)
            await writer.wait_synced(120)
            dt = time.perf_counter() - t0
            st = await client.status()
            samples.append({"t": round(dt, 1), "db_mb": st.db_size / MB,
                            "in_use_mb": st.db_size_in_use / MB, "revision": st.revision})
            ops = writer.segments_written + writer.deletes_written
            out = {
                "seconds": dt, "offered_changes_s": rate, "changes": writer.changes,
                "changes_s": writer.changes / dt, "etcd_ops": ops, "txns": writer.txns,
                "segments": writer.segments, "coalescing_gain": writer.changes / max(1, ops),
                "raw_puts_avoided_ratio": writer.changes / max(1, writer.txns),
                "peak_pending": peak_pending, "resyncs": writer.resyncs,
                "db_samples": samples,
            }
            await writer.close()
    finally:
        await client.delete(b"/bench-churn/", prefix=True)
        await client.close()
    return out


def growth(samples: list[dict[str, float]]) -> dict[str, float]:
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
    first, last = half[0], half[-1]
    span = max(1e-9, last["t"] - first["t"])
    return {"db_mb_max": max(s["db_mb"] for s in samples),
            "db_mb_end": samples[-1]["db_mb"],
            "in_use_mb_max": max(s["in_use_mb"] for s in samples),
            "second_half_growth_mb_min": (last["db_mb"] - first["db_mb"]) / span * 60}


def start_etcd(extra: list[str]) -> EtcdCluster:
    cluster = EtcdCluster(1)
    cluster.members[0].extra_args = list(extra)  # later flags win over COMPACTION_ARGS
    return cluster.start()


# --- main -------------------------------------------------------------------------------------


async def etcd_parts(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    cluster = start_etcd([])
    try:
        res["write"] = await write_path(cluster.endpoints, args.write_blocks, args.raw_puts)
        w = res["write"]
        show("write path (one etcd, same client)", [
            ("raw put, 1 in flight", f"{w['raw_put_seq_blocks_s']:,.0f} blocks/s"),
            (f"raw put, {w['writer_config']['max_inflight']} in flight",
             f"{w['raw_put_conc_blocks_s']:,.0f} blocks/s"),
            ("BlockWriter", f"{w['writer_blocks_s']:,.0f} blocks/s  ({w['blocks']:,} blocks, "
                            f"{w['txns']:,} txns, {w['ops_per_txn']:.0f} ops/txn)"),
            ("ratio writer / raw (in flight)", f"{w['ratio_vs_raw_conc']:.1f}x   (goal >= 5x)"),
            ("ratio writer / raw (1 in flight)", f"{w['ratio_vs_raw_seq']:.1f}x"),
            ("visible in a mirror", f"{w['mirror_visible_blocks_s']:,.0f} blocks/s"),
            ("mirror watch lag p50 / p99", f"{w['mirror_lag_p50_ms']:.1f} / "
                                           f"{w['mirror_lag_p99_ms']:.1f} ms at that rate"),
            ("memory of a mirror loaded from etcd", f"{w['mirror_reload_bytes_per_block']:.0f} B "
                                                    "per block (tracemalloc)"),
        ])
        res["churn_gain"] = {}
        rows = []
        for label, rate, cap in (("short-lived blocks", args.gain_rate, args.gain_capacity),
                                 ("etcd overloaded", args.overload_rate, args.capacity // 4)):
            g = res["churn_gain"][label] = await churn(cluster.endpoints, args.gain_s, rate, cap)
            life = cap / (rate / 2)
            rows += [
                (f"{label}: offered", f"{rate:,.0f} changes/s, LRU of {cap:,} blocks "
                                      f"(a block lives ~{life * 1e3:.0f} ms)"),
                ("  made / written", f"{g['changes']:,} changes ({g['changes_s']:,.0f}/s) -> "
                                     f"{g['etcd_ops']:,} etcd ops in {g['txns']:,} txns"),
                ("  coalescing gain", f"{g['coalescing_gain']:.2f}x fewer etcd ops than changes;"
                                      f" {g['raw_puts_avoided_ratio']:.0f}x fewer requests "
                                      "than one put per change"),
                ("  peak pending / resyncs", f"{g['peak_pending']:,} / {g['resyncs']}"),
            ]
        show("coalescing under churn (flush window 10 ms / 1,000 ops)", rows)
        res["churn_project_settings"] = await churn(cluster.endpoints, args.churn_s,
                                                    args.churn_rate, args.capacity)
    finally:
        cluster.stop()
    periodic = ["--auto-compaction-mode=periodic",
                f"--auto-compaction-retention={args.periodic_retention}"]
    cluster = start_etcd(periodic)
    try:
        res["churn_periodic"] = await churn(cluster.endpoints, args.churn_s, args.churn_rate,
                                            args.capacity)
    finally:
        cluster.stop()
    for key, label in (("churn_project_settings", " ".join(COMPACTION_ARGS[:2])),
                       ("churn_periodic", " ".join(periodic))):
        c = res[key]
        c["db"] = growth(c["db_samples"])
        show(f"churn, LRU of {args.capacity:,} blocks, etcd {label}", [
            ("changes", f"{c['changes']:,} in {c['seconds']:.0f} s = {c['changes_s']:,.0f}/s "
                        f"(offered {c['offered_changes_s']:,.0f}/s)"),
            ("etcd ops written", f"{c['etcd_ops']:,} in {c['txns']:,} txns"),
            ("coalescing gain", f"{c['coalescing_gain']:.2f}x fewer ops than changes; "
                                f"{c['raw_puts_avoided_ratio']:.0f} changes per etcd request"),
            ("peak pending / resyncs", f"{c['peak_pending']:,} / {c['resyncs']}"),
            ("db size max / end", f"{c['db']['db_mb_max']:.1f} / {c['db']['db_mb_end']:.1f} MB"
                                  f" (in use max {c['db']['in_use_mb_max']:.1f} MB)"),
            ("db growth, 2nd half", f"{c['db']['second_half_growth_mb_min']:+.1f} MB/min"),
            *([("note", "revision mode compacts only every 5 min (etcd's fixed interval), so no "
                        "compaction happens in this run; at this rate the file would reach "
                        f"~{c['db']['db_mb_end'] + c['db']['second_half_growth_mb_min'] * (5 - c['seconds'] / 60):,.0f}"  # noqa: E501
                        " MB before the first one")]
              if "revision" in label else
              [("note", "compacts every retention period, keeping one period of history: the "
                        "file stops growing once freed pages are reused (~2 periods)")]),
            ("samples t:db_mb", " ".join(f"{s['t']:.0f}:{s['db_mb']:.0f}"
                                         for s in c["db_samples"])),
        ])
    return res


def scale_part(args: argparse.Namespace, write: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    out = []
    raw = write.get("raw_put_conc_blocks_s")
    # Oldest chains evicted first (an LRU of stores), then blocks evicted at random (the worst
    # case for segments: most evictions rewrite another segment).
    for writers, scatter in ((1, False), (2, False), (4, False), (1, True), (2, True)):
        r = _index_scale.run_shards(1, writers, args.scale_rate, args.scale_s, args.capacity,
                                    scatter=scatter)
        out.append(r)
        vs = f", {r['changes_s'] / raw:,.0f}x one key per block" if raw else ""
        rows.append((f"{writers} writer process{'es' if writers > 1 else ''}"
                     f"{', random evictions' if scatter else ''}",
                     f"{r['changes_s']:,.0f} changes/s ({r['changes_per_op']:.0f} per etcd op, "
                     f"{r['etcd_ops_s']:,.0f} ops/s{vs}); lag p50 {r['lag_p50_ms']:.1f} / p99 "
                     f"{r['lag_p99_ms']:.1f} ms; db {r['db_mb']:.0f} MB"))
    show(f"block changes/s through one etcd (each writer offered {args.scale_rate:,.0f}/s, "
         f"LRU of {args.capacity:,} blocks, {args.scale_s:.0f} s)", rows)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes, about a minute")
    p.add_argument("--parts", default="etcd,scale,shards,lookup,dynamo",
                   help="comma-separated parts to run: etcd (write path, churn), scale (writer "
                        "processes at once), shards (changes/s over 1/2/4 etcds), lookup, dynamo "
                        "(ours vs Dynamo's RadixTree; pins the process to one CPU, so it runs "
                        "last)")
    p.add_argument("--etcd-cpu", type=float, default=0.25,
                   help="part shards: cores each etcd is capped at (cgroup v1; needs root)")
    p.add_argument("--periodic-retention", default=None,
                   help="auto-compaction retention of the periodic-mode churn run (default 10s, "
                        "5s with --quick): a time-compressed stand-in for a production 1m")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "index.json"))
    args = p.parse_args()
    q = args.quick
    args.write_blocks = 60_000 if q else 200_000
    args.raw_puts = 3_000 if q else 8_000
    args.churn_s = 15.0 if q else 50.0
    args.churn_rate = 20_000.0
    args.capacity = 20_000
    args.gain_s = 6.0 if q else 10.0
    args.scale_rate = 600_000.0  # more than one writer process makes on this CPU
    args.scale_s = 6.0 if q else 15.0
    args.gain_rate = 40_000.0
    args.gain_capacity = 100
    args.overload_rate = 150_000.0
    args.periodic_retention = args.periodic_retention or ("5s" if q else "10s")
    args.blocks = 1_000_000
    args.lookups = 500 if q else 2_000
    logging.basicConfig(level=logging.WARNING)
    t0 = time.time()
    print(f"kvatlas block index benchmark ({'quick' if q else 'full'}); etcd launch settings: "
          f"{' '.join(COMPACTION_ARGS)}; {os.cpu_count()} CPUs")
    results: dict[str, Any] = {"quick": q, "compaction_args": COMPACTION_ARGS}
    if "etcd" in args.parts:
        results.update(asyncio.run(etcd_parts(args)))
    if "scale" in args.parts:
        results["scale"] = scale_part(args, results.get("write", {}))
    if "shards" in args.parts:
        results["shards"] = _index_scale.shards_part(q, args.etcd_cpu, args.capacity, show)
    if "lookup" in args.parts:
        results.update(cpu_parts(args))
    if "dynamo" in args.parts:
        results["dynamo"] = dynamo_part(args.blocks, args.lookups)
    results["wall_s"] = time.time() - t0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float))
    print(f"\nwrote {args.out} in {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
