"""``kvatlas doctor``'s index links: why a router would see no prefix at an instance.

The silent zero hit: routing works, nothing fails, and yet no request ever hits a cache, because
the router hashes other blocks than the engine stores. Each cause is named per prefill from two
sources, the router's ``GET /debug/index_health`` (its settings against each record, what each
instance served, its canaries) and the ingestion counters in etcd
(``/{prefix}/v1/stats/{id}``, written by a sidecar or the index agent):

- **settings**: the record's block size, hash namespace or tokenizer differ from the router's
  (the router ignores that instance's index entries);
- **rejected**: events refused, by reason (``block_size_mismatch``: the engine's page size is
  not the block size);
- **arrive**: an instance that served requests of at least one full block, but no KV event was
  received from it and the index holds none of its blocks;
- **match**: events arrive, yet the block hashes of prompts it served (the router's canaries)
  are never found in the index: the engine's token ids are not the router's.

Pure: the caller fetches both documents and turns each tuple into a link.
"""
from __future__ import annotations

from typing import Any

CheckedLink = tuple[str, bool, str, str]
"""(name, ok, detail, hint): what ``Doctor._add`` takes."""

MIN_MISSES = 2
"""Canaries that missed, none hit, before the hashes are called mismatched (one miss can be an
eviction)."""

REASON_HINTS = {
    "block_size_mismatch": "the engine's page size differs from the index block size: start it "
                           "with --page-size equal to the sidecar's and the router's "
                           "--block-size (SGLang defaults to 1)",
    "token_count_mismatch": "the engine's events carry fewer token ids than blocks: upgrade it "
                            "to a release whose events carry token_ids",
    "lora_without_name": "the engine names adapters by id only: publish lora_name",
    "extra_keys": "multimodal or salted blocks are not indexed (by design)",
    "unknown_parent": "events were lost (gaps); give the sidecar --replay with the engine's "
                      "replay endpoint",
}


def index_links(iid: str, health: dict[str, Any] | None,
                stats: dict[str, Any] | None) -> list[CheckedLink]:
    """The four index links of prefill ``iid``; ``health`` is its entry in the router's
    ``/debug/index_health`` (None: the router does not list it), ``stats`` its counters."""
    links: list[CheckedLink] = []
    h = health or {}
    ignored = h.get("ignored") or []
    detail = "; ".join(f"{m.get('field')}: router {m.get('router')}, instance "
                       f"{m.get('instance')}" for m in ignored)
    links.append((f"{iid}: index settings match the router", not ignored,
                  detail or "block size, hash namespace and tokenizer agree",
                  "the router ignores this instance's index entries: make the sidecar's "
                  "--block-size, the engine's --page-size and the router's --block-size equal, "
                  "and give the sidecar and the router the engine's tokenizer (--tokenizer)"))
    rejected = {k: v for k, v in ((stats or {}).get("rejected") or {}).items() if v}
    shown = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()))
    links.append((f"{iid}: no KV events rejected", not rejected,
                  f"rejected: {shown}" if rejected else
                  ("none" if stats else "no ingestion counters (the engine indexes itself)"),
                  "; ".join(REASON_HINTS.get(k, f"{k}: see `kvatlas index stats`")
                            for k in sorted(rejected))))
    served = int(h.get("requests_with_blocks") or 0)
    received = (stats or {}).get("received")
    blocks = int(h.get("index_blocks") or 0)
    silent = served > 0 and blocks == 0 and (stats is None or not received)
    links.append((f"{iid}: KV events arrive", not silent,
                  f"served {served} requests of >= 1 full block; "
                  f"{'no counters' if stats is None else f'{received or 0} event batches received'}"
                  f"{_publishers(stats)}"
                  f"; the index holds {blocks} of its blocks",
                  "the engine publishes where nobody listens: its --kv-events-config endpoint "
                  "must equal the sidecar's --kv-events (the sidecar binds it; DP rank r on port "
                  "+ r) and the topic must match the sidecar's --topic"))
    canary = h.get("canary") or {}
    hits, misses = int(canary.get("hits") or 0), int(canary.get("misses") or 0)
    # Without events every canary misses: that cause is the link above, not this one.
    mismatched = hits == 0 and misses >= MIN_MISSES and not silent
    links.append((f"{iid}: its blocks match the router's hashes", not mismatched,
                  "not judged: no events arrive" if silent else
                  f"canaries (block hashes of prompts it served, looked up later): {hits} "
                  f"found, {misses} missing" if hits or misses else "no canary checked yet",
                  "its events arrive but hash to other blocks than the router's: the engine "
                  "tokenizes differently (give the sidecar and the router the engine's "
                  "--tokenizer; check the chat template) or hashes in another namespace (LoRA, "
                  "cache salt)"))
    return links


def _publishers(stats: dict[str, Any] | None) -> str:
    """``, N publishers connected`` where the counters say (a sidecar or agent that binds sees
    its engine's publisher connect; 0 means the engine publishes elsewhere or not at all)."""
    n = (stats or {}).get("publishers")
    return "" if n is None else f", {n} publisher{'' if n == 1 else 's'} connected"
