"""The table and notes ``bench/routing_quality.py`` prints from its result document."""
from __future__ import annotations

from typing import Any


def _workers(setup: dict[str, Any]) -> str:
    return "aggregated engines" if setup.get("fleet") == "aggregated" else "prefills"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = result["runs"]
    rr = runs.get("round_robin", {}).get("cached_tokens")
    ca = runs.get("sglang:cache_aware", {}).get("cached_tokens")
    off = result["offline"]
    t = Table(title=f"routing quality: {result['trace']['requests']} requests, "
                    f"{result['trace']['prompt_tokens']} prompt tokens, "
                    f"{result['setup']['prefills']} "
                    f"{_workers(result['setup'])} x {result['setup']['prefill_pages']} "
                    f"pages + {result['setup'].get('host_pages', 0)} host (union "
                    f"{off['union_blocks']} of {result['trace']['distinct_blocks']} "
                    f"distinct blocks)")
    for col in ("router", "cached tok", "hit %", "computed tok", "vs round_robin",
                "vs cache_aware", "vs oracle", "TTFT p50 ms", "TTFT p90 ms", "req max/mean",
                "errors", "wall s"):
        t.add_column(col)
    total = result["trace"]["prompt_tokens"]
    for name, r in runs.items():
        if "error" in r:
            t.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", "-", r["error"][:40], "-")
            continue
        c = r["cached_tokens"]
        # vllm-pd: push runs against push's round robin
        base = runs.get("round_robin@push", {}).get("cached_tokens") if name.endswith(
            "@push") else rr
        t.add_row(name, f"{c:.0f}", f"{100 * c / total:.1f}", f"{r['prefill_computed_tokens']:.0f}",
                  f"{c / base:.2f}x" if base else "-", f"{c / ca:.2f}x" if ca else "-",
                  f"{c / off['oracle_belady']:.2f}" if off["oracle_belady"] else "-",
                  f"{r['ttft_p50_ms']}", f"{r['ttft_p90_ms']}",
                  f"{r['spread']:.2f}" if r.get("spread") else "-", str(r["errors"]),
                  f"{r['wall_s']}")
    for name, key in (("oracle (Belady bound)", "oracle_belady"),
                      ("infinite-cache bound", "infinite_cache"),
                      ("sim: round robin LRU", "sim_round_robin"),
                      ("sim: prefix affinity LRU", "sim_affinity")):
        v = off[key]
        t.add_row(name, f"{v}", f"{100 * v / total:.1f}", f"{total - v}",
                  f"{v / rr:.2f}x" if rr else "-", f"{v / ca:.2f}x" if ca else "-",
                  "-", "-", "-", "-", "-", "-")
    Console(width=200).print(t)
    print("TTFT = request sent to the router -> first streamed token event through it.")
    for name, r in runs.items():
        view = r.get("router_view") or {}
        if view.get("pd_selections"):
            print(f"{name}: {view['random_fallbacks']} random fallbacks ('No tree found for "
                  f"model') in {view['pd_selections']} PD pair selections (its prefill and "
                  f"decode policy log one each): cache_aware placed requests at random")
        elif "prefix_hit_tokens" in view and name == "kv_aware":
            print(f"{name}: the router expected {view['prefix_hit_tokens']:.0f} prefix-hit tokens "
                  f"(index + its predictions); the prefills served {r['cached_tokens']:.0f}")
        if view.get("prediction_puts") and r.get("etcd_puts"):
            n = result["trace"]["requests"]
            print(f"{name}: shared predictions cost {view['prediction_puts']:.0f} etcd puts "
                  f"({view['prediction_puts'] / n:.2f} per request, "
                  f"{view['prediction_bytes'] / 1024:.0f} KiB) of the run's "
                  f"{r['etcd_puts']:.0f} ({100 * view['prediction_puts'] / r['etcd_puts']:.0f}%); "
                  f"{view.get('shared_received', 0):.0f} taken by the other routers")
