"""``kvatlas index stats``: per instance, its indexed blocks and ingestion counters; then etcd.

Sources, all read in one short session:
- block counts: one keys-only snapshot of ``/blocks/`` (every model), counted per model/instance;
- event counters: the ``/stats/{instance}`` values that index agents (and engines indexing
  themselves) publish under their lease (``index.agent_stats``); an instance whose writer
  publishes none shows ``-``;
- mirror lag: a short-lived watch of ``/blocks/`` from the snapshot revision + 1, for ``--sample``
  seconds, measuring what any router mirror sees: for each put, apply time minus the writer's
  write time (the ``"t"`` of the value; needs synchronized clocks). p50/p99 per instance, ``idle``
  when that instance wrote nothing meanwhile;
- ``write lag``: the agent's own figure, how long its oldest change not yet in etcd has waited;
- etcd's status: db size (and in use) and revision.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from index.agent_stats import parse_stats_key, stats_prefix
from index.etcd import EtcdClient, EtcdSettings, EtcdStatus, KeyValue
from index.keys import KeyLayout, loads
from index.mirror import write_time
from index.segments import decode
from kvatlas.commands._run_dir import cluster_access, index_shard_settings


def add_stats_parser(sub: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "stats", help="per-instance blocks, event counters and mirror lag; etcd size",
        description="For each instance: blocks in the index, last KV-event sequence number, "
                    "events applied and rejected (published by the index agent), write lag and "
                    "mirror lag (sampled by watching the block keys for --sample seconds); then "
                    "etcd's db size and revision.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--sample", type=float, default=1.0,
                        help="seconds to watch block writes for the mirror lag (0: skip; "
                             "default 1)")
    parser.set_defaults(func=cmd_stats)
    return parser


async def _sample_lag(client: EtcdClient, layout: KeyLayout, revision: int,
                      seconds: float) -> dict[str, list[float]]:
    """Write-to-watch lag of every block put in the next ``seconds``, per instance."""
    lags: dict[str, list[float]] = {}
    if seconds <= 0:
        return lags

    async def follow() -> None:
        async for batch in client.watch_prefix(layout.blocks_prefix(), revision + 1):
            now = time.time()
            for ev in batch.events:
                if not ev.put:
                    continue
                t = write_time(ev.value)
                if t is None:
                    continue
                try:
                    _, instance, _ = layout.parse_segment(ev.key)
                except ValueError:
                    continue
                lags.setdefault(instance, []).append(max(0.0, now - t))

    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(follow(), seconds)
    return lags


def _pct(samples: list[float], q: int) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, (len(s) * q) // 100)]


async def gather_stats(args: argparse.Namespace) -> dict[str, Any]:
    access = cluster_access(args)
    layout = access.layout
    shard_settings = index_shard_settings(args)  # before any etcd call: bad flags fail fast
    async with EtcdClient(access.main_etcd) as client:
        status = await client.status()  # first: fails fast when etcd is away
        _, stat_kvs = await client.get_prefix(stats_prefix(layout))
        main = client.settings
        shards = await asyncio.gather(*(
            _shard_stats(args, layout, s, client if s == main else None)
            for s in shard_settings))
    segments = [kv for sh in shards for kv in sh.segments]
    lags: dict[str, list[float]] = {}
    for sh in shards:
        for instance, samples in sh.lags.items():
            lags.setdefault(instance, []).extend(samples)
    blocks: dict[tuple[str, str], int] = {}
    for kv in segments:
        try:
            model, instance, _ = layout.parse_segment(kv.key)
            n = len(decode(kv.value).hashes)
        except ValueError:  # MalformedSegment included
            continue
        blocks[(model, instance)] = blocks.get((model, instance), 0) + n
    published: dict[str, dict[str, Any]] = {}
    for kv in stat_kvs:
        try:
            instance = parse_stats_key(layout, kv.key)
            doc = loads(kv.value)
        except ValueError:
            continue
        if isinstance(doc, dict):
            published[instance] = doc
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for (model, instance), n in blocks.items():
        rows[(model, instance)] = {"instance_id": instance, "model": model, "blocks": n}
    for instance, doc in published.items():
        model = str(doc.get("model", "?"))
        rows.setdefault((model, instance), {"instance_id": instance, "model": model, "blocks": 0})
    now = time.time()
    out = []
    for key in sorted(rows, key=lambda k: (k[1], k[0])):
        row = rows[key]
        doc = published.get(row["instance_id"])
        if doc is not None and doc.get("model", row["model"]) != row["model"]:
            doc = None  # counters belong to the model the publisher ingests
        rejected = doc.get("rejected") if doc else None
        malformed = doc.get("malformed") if doc else None
        samples = lags.get(row["instance_id"], [])
        row.update({
            "state": doc.get("state") if doc else None,
            "last_seq": doc.get("last_seq") if doc else None,
            "applied": doc.get("applied") if doc else None,
            "rejected": rejected if isinstance(rejected, dict) else None,
            "rejected_total": sum(v for v in rejected.values() if isinstance(v, int))
            if isinstance(rejected, dict) else None,
            "malformed_total": sum(v for v in malformed.values() if isinstance(v, int))
            if isinstance(malformed, dict) else None,
            "write_lag_s": doc.get("write_lag_s") if doc else None,
            "stats_age_s": round(now - doc["ts"], 3)
            if doc and isinstance(doc.get("ts"), (int, float)) else None,
            "mirror_lag_s": {"samples": len(samples), "p50": round(_pct(samples, 50), 6),
                             "p99": round(_pct(samples, 99), 6)} if samples else None,
        })
        out.append(row)
    result: dict[str, Any] = {
        "instances": out,
        "etcd": _etcd_doc(client.endpoint, status),
        "sample_s": args.sample,
    }
    if len(shards) > 1 or shards[0].endpoint != client.endpoint:
        result["index_shards"] = [
            {**_etcd_doc(sh.endpoint, sh.status),
             "instances": len({parse_instance(layout, kv.key) for kv in sh.segments} - {None}),
             "segments": len(sh.segments)} for sh in shards]
    return result


def _etcd_doc(endpoint: str, status: EtcdStatus) -> dict[str, Any]:
    return {"endpoint": endpoint, "version": status.version, "db_size": status.db_size,
            "db_size_in_use": status.db_size_in_use, "revision": status.revision}


def parse_instance(layout: KeyLayout, key: bytes) -> str | None:
    try:
        return layout.parse_segment(key)[1]
    except ValueError:
        return None


@dataclass
class ShardStats:
    """What ``index stats`` read of one index shard."""

    endpoint: str
    status: EtcdStatus
    segments: list[KeyValue]
    lags: dict[str, list[float]]


async def _shard_stats(args: argparse.Namespace, layout: KeyLayout, settings: EtcdSettings,
                       main: EtcdClient | None) -> ShardStats:
    """One shard's segments and sampled lags (``main``: the shard is the main etcd, read with
    its client)."""
    async with contextlib.AsyncExitStack() as stack:
        client = main or await stack.enter_async_context(EtcdClient(settings))
        status = await client.status()
        revision, segments = await client.get_prefix(layout.blocks_prefix())
        lags = await _sample_lag(client, layout, revision, args.sample)
    return ShardStats(client.endpoint, status, segments, lags)


def _fmt(v: Any) -> str:
    return "-" if v is None else str(v)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def cmd_stats(args: argparse.Namespace) -> int:
    if not 0 <= args.sample <= 60:
        raise ValueError(f"--sample must be within [0, 60] s, got {args.sample}")
    result = asyncio.run(gather_stats(args))
    if args.json:
        print(json.dumps(result))
        return 0
    out = Console(width=None if sys.stdout.isatty() else 200)
    rows = result["instances"]
    if rows:
        table = Table(title=f"{len(rows)} indexed instance(s)", title_justify="left")
        for col in ("instance", "model", "state", "blocks", "last seq", "applied", "rejected",
                    "malformed", "write lag", "mirror lag p50/p99"):
            table.add_column(col, justify="left" if col in ("instance", "model", "state") else "right")
        for r in rows:
            lag = r["mirror_lag_s"]
            mirror = ("idle" if args.sample > 0 else "-") if lag is None else \
                f"{lag['p50'] * 1e3:.1f}/{lag['p99'] * 1e3:.1f} ms ({lag['samples']})"
            rej = r["rejected_total"]
            if rej and r["rejected"]:
                rej = ", ".join(f"{k} {v}" for k, v in sorted(r["rejected"].items()))
            wl = r["write_lag_s"]
            table.add_row(r["instance_id"], r["model"], _fmt(r["state"]), str(r["blocks"]),
                          _fmt(r["last_seq"]), _fmt(r["applied"]), _fmt(rej),
                          _fmt(r["malformed_total"]),
                          "-" if wl is None else f"{wl * 1e3:.0f} ms", mirror)
        out.print(table)
    else:
        out.print("no instance has blocks or counters in the index")
    e = result["etcd"]
    out.print(f"etcd {e['endpoint']} (v{e['version']}): db size {_size(e['db_size'])} "
              f"({_size(e['db_size_in_use'])} in use), revision {e['revision']}")
    for i, e in enumerate(result.get("index_shards", [])):
        out.print(f"index shard {i}: etcd {e['endpoint']} (v{e['version']}): "
                  f"{e['instances']} instance(s), {e['segments']} segments, db size "
                  f"{_size(e['db_size'])} ({_size(e['db_size_in_use'])} in use), "
                  f"revision {e['revision']}")
    return 0
