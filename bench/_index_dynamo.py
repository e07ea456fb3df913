"""Part ``dynamo`` of bench/index.py: ``BlockTable`` against Dynamo's Rust ``RadixTree``.

Not a benchmark on its own; ``bench/index.py --parts dynamo`` runs it. One workload, fed to both:
chains of ``CHAIN`` blocks, the first holder of a chain holding all of it and ``REPLICAS - 1``
more a random prefix of it, stored in events of ``EVENT_BLOCKS`` blocks (a segment's worth), at
8, 64 and 256 workers. Dynamo gets each event as the serialized ``KvCacheEvent`` its
``RadixTree.apply_event`` reads (serialized before the clock starts: only the apply is timed);
ours gets ``BlockTable.apply_add``. Then:

- lookups of the same prompts on both (full hits of 64 and 256 blocks, and 256-block prompts
  that leave the cached chain at a random block), every answer compared: Dynamo's per-worker
  score and our per-instance match must be the same number of leading blocks;
- apply rate, blocks/s: storing the whole workload, then churn (a holder drops a chain's last
  event worth of blocks and stores them again);
- our etcd mirror (``BlockMirror.apply``) on the same blocks as segment puts: its apply rate
  (segments decoded and diffed) and its memory per distinct block (tracemalloc: table, raw
  segment values, keys).

Both sides run pinned to one CPU (``os.sched_setaffinity`` before Dynamo is imported, so its
background thread inherits it): ``RadixTree`` calls hop to that thread, and on an idle
multi-CPU machine the wake-up alone costs tens of microseconds, which is not the tree's cost.
"""
from __future__ import annotations

import gc
import json
import os
import random
import time
import tracemalloc
from collections.abc import Iterator
from functools import partial
from typing import Any

from _index_lookup import pct, show

from index.etcd import WatchEvent
from index.keys import KeyLayout
from index.mirror import BlockMirror
from index.segments import encode
from index.table import BACKEND, BlockTable

CHAIN = 1024
REPLICAS = 4
EVENT_BLOCKS = 64
MODEL = "bench/model"

Event = tuple[int, int | None, list[int]]
"""(worker, parent hash or None, block hashes): one store event."""


def pin_one_cpu() -> str:
    """Pin this process (and the threads it starts from now on) to one CPU; say which."""
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return f"pinned to CPU {cpu} (os.sched_setaffinity, before Dynamo starts its thread)"


def threads_cpus() -> dict[str, str]:
    """Per thread of this process, the CPUs it may run on (to show the pin holds for all)."""
    out = {}
    for tid in sorted(os.listdir("/proc/self/task")):
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    out[tid] = line.split(":", 1)[1].strip()
    return out


def workload(n_blocks: int, n_workers: int, rng: random.Random) -> tuple[list[Event], list[list[int]]]:
    events: list[Event] = []
    chains: list[list[int]] = []
    for _ in range(n_blocks // CHAIN):
        hs = [rng.getrandbits(64) for _ in range(CHAIN)]
        holders = rng.sample(range(n_workers), min(REPLICAS, n_workers))
        for k, w in enumerate(holders):
            upto = CHAIN if k == 0 else rng.randrange(1, CHAIN)
            for start in range(0, upto, EVENT_BLOCKS):
                end = min(upto, start + EVENT_BLOCKS)
                events.append((w, hs[start - 1] if start else None, hs[start:end]))
        chains.append(hs)
    return events, chains


def stored_json(event_id: int, parent: int | None, hashes: list[int]) -> bytes:
    # Chained hashes name their whole prefix, so each is both Dynamo's sequence hash
    # (block_hash, which parent_hash refers to) and the per-block hash it matches on (tokens_hash).
    return json.dumps({"event_id": event_id, "data": {"stored": {
        "parent_hash": parent, "blocks": [{"block_hash": h, "tokens_hash": h} for h in hashes]}}}).encode()


def removed_json(event_id: int, hashes: list[int]) -> bytes:
    return json.dumps({"event_id": event_id, "data": {"removed": {"block_hashes": hashes}}}).encode()


def prompts(chains: list[list[int]], n: int, rng: random.Random) -> dict[str, list[list[int]]]:
    out: dict[str, list[list[int]]] = {"hit 64": [], "hit 256": [], "partial 256": []}
    for _ in range(n):
        out["hit 64"].append(rng.choice(chains)[:64])
        out["hit 256"].append(rng.choice(chains)[:256])
        k = rng.randrange(1, 256)
        out["partial 256"].append(rng.choice(chains)[:k] + [rng.getrandbits(64) for _ in range(256 - k)])
    return out


def time_both(calls: tuple[Any, Any], queries: list[list[int]],
              rounds: int) -> tuple[list[dict[str, float]], list[list[Any]]]:
    """Per side (ours, Dynamo), p50/p99 in us over ``queries``: the round with the lowest p99 of
    ``rounds``, and the answers of the first round. The two sides alternate query by query (and
    which goes first), so that whatever else the machine runs meanwhile falls on both alike; a
    round another process preempted more says nothing about either structure."""
    clock = time.perf_counter_ns
    best: list[dict[str, float]] = [{}, {}]
    answers: list[list[Any]] = [[], []]
    for r in range(rounds):
        wall: tuple[list[int], list[int]] = ([], [])
        gc.disable()
        try:
            for j, q in enumerate(queries):
                for side in ((0, 1) if j % 2 else (1, 0)):
                    call = calls[side]
                    t = clock()
                    a = call(q)
                    wall[side].append(clock() - t)
                    if r == 0:
                        answers[side].append(a)
        finally:
            gc.enable()
        for side in (0, 1):
            us = [t / 1e3 for t in wall[side]]
            res = {"p50_us": pct(us, 0.5), "p99_us": pct(us, 0.99)}
            if not best[side] or res["p99_us"] < best[side]["p99_us"]:
                best[side] = res
    return best, answers


def dynamo_answer(tree: Any, names: list[str], q: list[int]) -> dict[str, int]:
    """Dynamo's scores as ``{instance: matched blocks}`` (worker ids are indexes into ``names``)."""
    return {names[w]: s for (w, _dp), s in tree.find_matches(q).scores.items()}


def build_ours(events: list[Event], names: list[str]) -> tuple[BlockTable, float]:
    table = BlockTable()
    clock = time.perf_counter_ns
    total = 0
    for w, _, hs in events:
        t = clock()
        table.apply_add(names[w], hs)
        total += clock() - t
    return table, total / 1e9


def build_dynamo(radix_tree: Any, events: list[Event]) -> tuple[Any, float]:
    tree = radix_tree()
    clock = time.perf_counter_ns
    total = 0
    for i, (w, parent, hs) in enumerate(events):
        raw = stored_json(i, parent, hs)
        t = clock()
        tree.apply_event(w, raw)
        total += clock() - t
    return tree, total / 1e9


def churn(chains: list[list[int]], events: list[Event], n: int,
          rng: random.Random) -> list[tuple[int, int, list[int]]]:
    """(worker, parent of the tail, tail) for ``n`` chains' full holders: drop it, store it again."""
    first_holder: dict[int, int] = {}  # a chain's first block -> the worker holding all of it
    for w, parent, hs in events:
        if parent is None:
            first_holder.setdefault(hs[0], w)  # the full holder's events come first
    out = []
    for c in rng.sample(chains, min(n, len(chains))):
        out.append((first_holder[c[0]], c[-EVENT_BLOCKS - 1], c[-EVENT_BLOCKS:]))
    return out


def mirror_events(events: list[Event], names: list[str], layout: KeyLayout) -> Iterator[list[WatchEvent]]:
    """The workload as segment puts, 100 per watch batch (one segment per event)."""
    batch: list[WatchEvent] = []
    for seg, (w, parent, hs) in enumerate(events):
        key = layout.segment(MODEL, names[w], seg)
        batch.append(WatchEvent(True, key, encode(time.time(), parent, hs, ["GPU"] * len(hs)), seg + 1))
        if len(batch) == 100:
            yield batch
            batch = []
    if batch:
        yield batch


def mirror_part(events: list[Event], names: list[str], traced: bool) -> dict[str, float]:
    """Our etcd mirror fed the workload as watch events: apply rate, or (``traced``) memory."""
    layout = KeyLayout()
    gc.collect()
    if traced:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    mirror = BlockMirror(None, layout, MODEL)  # type: ignore[arg-type]  # never connects
    applied = 0.0
    clock = time.perf_counter
    for batch in mirror_events(events, names, layout):
        t = clock()
        mirror.apply(batch)
        applied += clock() - t
        del batch
    blocks = mirror.block_count()
    if traced:
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        return {"blocks": blocks, "bytes": used, "bytes_per_block": used / blocks}
    entries = mirror.table().entries()
    return {"blocks": blocks, "entries": entries, "apply_s": applied, "blocks_s": entries / applied}


def run_workers(radix_tree: Any, n_workers: int, n_blocks: int, n_lookups: int,
                rng: random.Random) -> dict[str, Any]:
    names = [f"prefill-{i:03d}" for i in range(n_workers)]
    events, chains = workload(n_blocks, n_workers, rng)
    entries = sum(len(hs) for _, _, hs in events)
    ours, ours_s = build_ours(events, names)
    tree, dyn_s = build_dynamo(radix_tree, events)
    res: dict[str, Any] = {"workers": n_workers, "blocks": len(ours), "entries": entries,
                           "apply": {"ours_blocks_s": entries / ours_s, "dynamo_blocks_s": entries / dyn_s}}
    dynamo_lookup = partial(dynamo_answer, tree, names)

    for kind, queries in prompts(chains, n_lookups, rng).items():
        (mine, theirs), (ours_ans, dyn_ans) = time_both((ours.lookup, dynamo_lookup), queries, 5)
        for q, a, b in zip(queries, ours_ans, dyn_ans):
            if a != b:
                raise AssertionError(f"{n_workers} workers, {kind}: ours {a} != dynamo {b} "
                                     f"for a {len(q)}-block prompt")
        res[kind] = {"ours": mine, "dynamo": theirs, "matched_blocks": sum(max(a.values(), default=0)
                                                                            for a in ours_ans)}
    ch = churn(chains, events, 2000, rng)
    clock = time.perf_counter_ns
    t_ours = t_dyn = 0
    for i, (w, parent, tail) in enumerate(ch):
        t = clock()
        ours.apply_remove(names[w], tail)
        ours.apply_add(names[w], tail)
        t_ours += clock() - t
        rm, st = removed_json(2 * i, tail), stored_json(2 * i + 1, parent, tail)
        t = clock()
        tree.apply_event(w, rm)
        tree.apply_event(w, st)
        t_dyn += clock() - t
    moved = 2 * EVENT_BLOCKS * len(ch)
    res["churn"] = {"ours_blocks_s": moved * 1e9 / t_ours, "dynamo_blocks_s": moved * 1e9 / t_dyn}
    probe = [c[:256] for c in chains[:200]]  # both still agree after the churn
    assert [ours.lookup(q) for q in probe] == [dynamo_lookup(q) for q in probe]
    res["threads_cpus"] = threads_cpus()  # while Dynamo's thread lives
    del ours, tree, dynamo_lookup
    gc.collect()
    res["mirror"] = mirror_part(events, names, traced=False)
    gc.collect()
    res["mirror"]["memory"] = mirror_part(events, names, traced=True)
    return res


def dynamo_part(n_blocks: int, n_lookups: int) -> dict[str, Any] | None:
    pin = pin_one_cpu()
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found]
    except ImportError:
        print("\n== dynamo: ai-dynamo-runtime is not installed; install the bench extras with "
              "`.venv/bin/pip install -e '.[bench]'` (or `pip install ai-dynamo-runtime`) and rerun")
        return None
    rng = random.Random(5)
    out: dict[str, Any] = {"pin": pin, "backend": BACKEND, "chain": CHAIN, "replicas": REPLICAS,
                           "event_blocks": EVENT_BLOCKS, "grid": {}}
    for w in (8, 64, 256):
        out["grid"][str(w)] = run_workers(RadixTree, w, n_blocks, n_lookups, rng)
        gc.collect()
    report(out)
    return out


def report(out: dict[str, Any]) -> None:
    rows = []
    kinds = ("hit 64", "hit 256", "partial 256")
    for w, r in out["grid"].items():
        for kind in kinds:
            o, d = r[kind]["ours"], r[kind]["dynamo"]
            rows.append((f"{w:>3} workers, {kind:<11} p50/p99 us",
                         f"ours {o['p50_us']:6.1f} / {o['p99_us']:6.1f}   "
                         f"dynamo {d['p50_us']:6.1f} / {d['p99_us']:6.1f}   "
                         f"x{d['p50_us'] / o['p50_us']:.1f} / x{d['p99_us'] / o['p99_us']:.1f}"))
        for part in ("apply", "churn"):
            a = r[part]
            rows.append((f"{w:>3} workers, {part:<11} blocks/s",
                         f"ours {a['ours_blocks_s'] / 1e6:5.2f} M   "
                         f"dynamo {a['dynamo_blocks_s'] / 1e6:5.2f} M   "
                         f"x{a['ours_blocks_s'] / a['dynamo_blocks_s']:.1f}"))
        m = r["mirror"]
        rows.append((f"{w:>3} workers, our etcd mirror",
                     f"apply {m['blocks_s'] / 1e6:.2f} M blocks/s (segment puts, decoded and diffed); "
                     f"{m['memory']['bytes_per_block']:.0f} B per distinct block"))
    g8 = out["grid"]["8"]
    show(f"ours (BlockTable, {out['backend']}) vs Dynamo RadixTree (ai-dynamo-runtime), same workload: "
         f"{g8['blocks']:,} blocks, {g8['entries']:,}+ entries; ratio x = how many times better ours is "
         f"(dynamo/ours for latency, ours/dynamo for rates; > 1: ours is better); {out['pin']}", rows)
    cpus = {c for r in out["grid"].values() for c in r["threads_cpus"].values()}
    threads = max(len(r["threads_cpus"]) for r in out["grid"].values())
    print(f"  CPUs the threads of this process (up to {threads}, Dynamo's included) may run on: "
          + ", ".join(sorted(cpus)))
