"""``bench/mixed_fleet.py --probe``: why long prompts are slower under the per-request choice.

The question: under ``choice`` the long one-shot prompts take the PD path as under
``always_pd``, yet their TTFT is higher. Either the router treats them differently (another
prefill, a wait at the router) or the prefills compute them more slowly because the
aggregated engines, idle under ``always_pd``, now compute the short prompts on the same CPUs.

Three settings on the same trace, each a fresh mixed cluster (``bench/_routing_cluster.py``):

- ``always_pd``: the router sees only the PD pool and serves everything;
- ``always_pd+load``: the router still sees only the PD pool and serves every request but the
  short ones, which go straight to the aggregated engines (round robin, the same ``/generate``
  body) at the moment the replay reaches them, as ``choice`` would send them: the CPU work of
  ``choice`` with the routing of ``always_pd`` (the control);
- ``choice``: the router sees both and chooses.

Every request asks for ``X-Kvatlas-Route``, so each long prompt's prefill is known; the
router's prefill upstream latency (``kvatlas_router_upstream_latency_seconds``, role prefill:
the router's call to the prefill, from send to its answer) is read before and after, so the
mean time a PD request spent at a prefill can be set against its TTFT through the router.
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import _routing_trace as rt
from _routing_cluster import Cluster, http_get, metric

PROBES = (("always_pd", "aggregated", False), ("always_pd+load", "aggregated", True),
          ("choice", None, False))
"""(setting, shape hidden from the router, short prompts sent straight to aggregated engines)."""


async def replay_split(router: str, direct: list[str], reqs: list[rt.Req], kinds: dict[int, str],
                       concurrency: int, timeout: float, direct_kind: str | None
                       ) -> dict[int, dict[str, Any]]:
    """Replay ``reqs`` at ``concurrency`` (a session's turn waits for the one before); requests
    of ``direct_kind`` go round robin to the ``direct`` engines, the rest through ``router``.
    Per request: TTFT (ms), where it went (``X-Kvatlas-Route``'s prefill or worker), errors."""
    import aiohttp

    out: dict[int, dict[str, Any]] = {}
    sent_direct = 0

    async def one(session: aiohttp.ClientSession, r: rt.Req) -> None:
        nonlocal sent_direct
        body = {"text": r.text, "stream": True,
                "sampling_params": {"max_new_tokens": r.max_new_tokens, "temperature": 0.0}}
        url = router
        if kinds[r.rid] == direct_kind:
            url = direct[sent_direct % len(direct)]
            sent_direct += 1
        t0 = time.perf_counter()
        row: dict[str, Any] = {"kind": kinds[r.rid], "direct": url != router}
        async with session.post(url + "/generate", json=body,
                                headers={"X-Kvatlas-Explain": "1"}) as resp:
            route = resp.headers.get("X-Kvatlas-Route")
            if route:
                info = json.loads(route)
                row["where"] = info.get("prefill") or info.get("worker")
                row["shape"] = "pd" if info.get("decode") else "aggregated"
            if resp.status != 200:
                row["error"] = f"{resp.status}: {(await resp.text())[:200]}"
            else:
                async for chunk in resp.content.iter_any():
                    if b"data:" in chunk and "ttft_ms" not in row:
                        row["ttft_ms"] = round(1000 * (time.perf_counter() - t0), 2)
        out[r.rid] = row

    def failed(r: rt.Req, exc: Exception) -> None:
        out[r.rid] = {"kind": kinds[r.rid], "error": f"{type(exc).__name__}: {exc}"}

    await rt.closed_loop(reqs, concurrency, timeout, one, failed)
    return out


def prefill_latency(router: str) -> tuple[float, float]:
    """The router's prefill upstream latency histogram: (sum of seconds, count)."""
    _, text = http_get(router + "/metrics", timeout=5)
    name = "kvatlas_router_upstream_latency_seconds"
    return (metric(text, f'{name}_sum{{role="prefill"}}'),
            metric(text, f'{name}_count{{role="prefill"}}'))


def run_probe(args: Any, etcd: str, i: int, logdir: Path, reqs: list[rt.Req],
              kinds: dict[int, str], setting: str, hide: str | None, load: bool
              ) -> dict[str, Any]:
    """One probe setting on a fresh mixed cluster: per-request rows and the prefill latency."""
    cluster = Cluster(args, etcd, f"/probe{i}x{int(time.time())}", logdir, "mixed", hide)
    try:
        cluster.start_workers()
        cluster.start_routers("kv_aware", 1)
        s0, n0 = prefill_latency(cluster.router_url)
        rows = asyncio.run(replay_split(cluster.router_url, [w["url"] for w in cluster.aggregated],
                                        reqs, kinds, args.concurrency, args.request_timeout,
                                        "short" if load else None))
        s1, n1 = prefill_latency(cluster.router_url)
    finally:
        cluster.stop()
    return {"setting": setting, "rows": rows, "prefill_calls": n1 - n0,
            "prefill_mean_ms": round(1000 * (s1 - s0) / (n1 - n0), 1) if n1 > n0 else None}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """Per kind: TTFT p50/mean; the long prompts' prefills and shapes; errors."""
    rows = run["rows"]
    out: dict[str, Any] = {"prefill_mean_ms": run["prefill_mean_ms"],
                           "prefill_calls": run["prefill_calls"],
                           "errors": sum(1 for r in rows.values() if "error" in r)}
    for kind in ("short", "long", "opener", "followup"):
        xs = sorted(r["ttft_ms"] for r in rows.values() if r["kind"] == kind and "ttft_ms" in r)
        out[kind] = {"n": len(xs), "p50": xs[len(xs) // 2] if xs else None,
                     "mean": round(sum(xs) / len(xs), 1) if xs else None}
    # the PD requests' TTFT against their time at the prefill: the rest is the router (its
    # decision and any admission wait) and the decode's first token
    pd = [r["ttft_ms"] for r in rows.values() if r.get("shape") == "pd" and "ttft_ms" in r]
    out["pd_ttft_mean_ms"] = round(sum(pd) / len(pd), 1) if pd else None
    if pd and run["prefill_mean_ms"] is not None:
        out["pd_outside_prefill_ms"] = round(out["pd_ttft_mean_ms"] - run["prefill_mean_ms"], 1)
    longs = [r for r in rows.values() if r["kind"] == "long"]
    out["long_where"] = {w: sum(1 for r in longs if r.get("where") == w)
                         for w in sorted({str(r.get("where")) for r in longs})}
    out["long_shapes"] = sorted({str(r.get("shape")) for r in longs})
    return out


def long_routes(runs: dict[str, dict[str, Any]]) -> dict[int, dict[str, str | None]]:
    """Each long prompt's prefill under every setting (rid -> setting -> instance)."""
    rids = sorted(rid for rid, r in next(iter(runs.values()))["rows"].items()
                  if r["kind"] == "long")
    return {rid: {s: run["rows"].get(rid, {}).get("where") for s, run in runs.items()}
            for rid in rids}
