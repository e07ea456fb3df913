"""``kvatlas doctor``'s vLLM links: why an attached vLLM engine would never hit a prefix.

vLLM fails silently in four ways, each checked per instance whose record says ``engine: vllm``
from what is at hand: its record (block size), the ingestion counters its sidecar writes to etcd
(batches received, publishers connected, events rejected by reason), its ``/v1/models`` (LoRA
adapters) and its ``/metrics`` (prompt tokens served, prefix-cache queries):

- **events**: it served prompts of at least one block, yet no KV-event publisher ever connected
  to its sidecar (``--kv-events-config`` missing, or its endpoint is not the sidecar's);
- **prefix caching**: it served prompts but made no prefix-cache query, or its publisher is
  connected and nothing was ever published (no prefix cache, no ``BlockStored``);
- **block size**: its events were refused as ``block_size_mismatch`` (``--block-size``);
- **namespace**: it serves LoRA adapters, or events were refused for extra keys (cache salt,
  multimodal) or an adapter without a name: those blocks hash in another namespace.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from index.agent_stats import parse_stats_key, stats_prefix
from index.errors import EtcdError
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, loads
from index.record import InstanceRecord

CheckedLink = tuple[str, bool, str, str]
"""(name, ok, detail, hint)."""

NAMESPACE_REASONS = ("extra_keys", "lora_without_name")


def metric_sum(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` in a Prometheus text exposition; None if absent."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            try:
                total = (total or 0.0) + float(line.rsplit("}", 1)[-1].split()[0])
            except (IndexError, ValueError):
                continue
    return total


def vllm_links(iid: str, rec: dict[str, Any], stats: dict[str, Any] | None,
               models: dict[str, Any] | None, metrics: str | None) -> list[CheckedLink]:
    """The four vLLM links of instance ``iid`` (pure: the caller fetched every document)."""
    st = stats or {}
    block = int(rec.get("block_size") or 0)
    prompt_tokens = metric_sum(metrics or "", "vllm:prompt_tokens_total") or 0.0
    queries = metric_sum(metrics or "", "vllm:prefix_cache_queries_total")
    served = prompt_tokens >= max(block, 1)
    received, publishers = int(st.get("received") or 0), st.get("publishers")
    rejected = {k: int(v) for k, v in (st.get("rejected") or {}).items() if v}
    seen = (f"{prompt_tokens:g} prompt tokens served; {received} event batches received, "
            f"{publishers if publishers is not None else 'unknown'} publisher(s) connected")

    no_publisher = served and not received and publishers == 0
    links: list[CheckedLink] = [(
        f"{iid}: vLLM KV events arrive", not no_publisher,
        ("no KV-event publisher connected: " if no_publisher else "") + seen,
        "start vLLM with --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": "
        "\"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv-events\"}' and give the "
        "sidecar --kv-events tcp://*:5557 (a remote engine: --kv-events tcp://HOST:5557 "
        "--kv-events-connect)")]

    caching_off = served and ((queries is not None and queries == 0)
                              or (not received and bool(publishers)))
    links.append((
        f"{iid}: vLLM prefix caching on", not caching_off,
        f"{queries:g} prefix-cache queries; {seen}" if queries is not None else seen,
        "start vLLM with --enable-prefix-caching: without it no block is cached and no "
        "BlockStored is ever published"))

    mismatched = rejected.get("block_size_mismatch", 0)
    links.append((
        f"{iid}: vLLM block size matches the index", not mismatched,
        f"rejected block_size_mismatch {mismatched}: the engine's blocks are not the index's "
        f"{block} tokens" if mismatched else f"no event refused for its block size ({block})",
        f"start vLLM with --block-size {block} (or the sidecar and the router with the "
        "engine's --block-size)"))

    adapters = [e.get("id") for e in ((models or {}).get("data") or [])
                if isinstance(e, dict) and e.get("parent")]
    odd = {k: rejected[k] for k in NAMESPACE_REASONS if k in rejected}
    problems = ([f"serves LoRA adapters {', '.join(map(str, adapters))}"] if adapters else []) + \
        [f"rejected {k} {v}" for k, v in sorted(odd.items())]
    links.append((
        f"{iid}: vLLM blocks in the base namespace", not problems,
        "; ".join(problems) or "no LoRA adapter served, no salted or multimodal block refused",
        "requests naming a LoRA adapter or carrying a cache_salt hash to other blocks than the "
        "router's base-model hashes: route them without prefix affinity, or serve adapters "
        "from instances of their own"))
    return links


async def vllm_doctor_links(etcd: EtcdSettings, layout: KeyLayout,
                            instances: Mapping[str, InstanceRecord],
                            timeout: float) -> list[CheckedLink]:
    """The links of every vLLM instance among ``instances`` (the doctor's read of the
    records); [] when there is none, or when etcd's counters cannot be read (the main doctor
    chain names that)."""
    records = {iid: rec.to_dict() for iid, rec in instances.items() if rec.engine == "vllm"}
    if not records:
        return []
    try:
        async with EtcdClient(etcd) as client:
            _, skvs = await client.get_prefix(stats_prefix(layout))
    except (EtcdError, OSError):
        return []
    counters: dict[str, Any] = {}
    for kv in skvs:
        try:
            counters[parse_stats_key(layout, kv.key)] = loads(kv.value)
        except ValueError:
            continue
    links: list[CheckedLink] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
        for iid, rec in sorted(records.items()):
            url = str(rec.get("url") or "").rstrip("/")
            models = await _get(http, f"{url}/v1/models", json_body=True)
            metrics = await _get(http, f"{url}/metrics", json_body=False)
            links += vllm_links(iid, rec, counters.get(iid),
                                models if isinstance(models, dict) else None,
                                metrics if isinstance(metrics, str) else None)
    return links


async def _get(http: aiohttp.ClientSession, url: str, *, json_body: bool) -> Any:
    """The body of a 200 answer (parsed JSON or text); None otherwise."""
    try:
        async with http.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None) if json_body else await resp.text()
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None
