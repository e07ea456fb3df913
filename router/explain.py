"""Why a request went where it went.

- ``X-Kvatlas-Route``: an opt-in response header (the request sends ``X-Kvatlas-Explain: 1``,
  or the router runs with ``--explain-routes``) carrying the chosen pair (or, for an
  aggregated worker, ``"worker"`` in place of ``"prefill"`` and ``"decode"``), the prompt's blocks,
  the chosen prefill's match by cache tier and the terms of its cost, as compact JSON::

      {"prefill":"p0","decode":"d0","block_size":16,"prompt_blocks":12,"matched_blocks":8,
       "index_blocks":8,"best_matched_blocks":8,"tiers":{"device":6,"host":2,"disk":0},
       "credited_blocks":7.5,"cost":13.0,"missed_blocks":4.5,"overlap_weight":2.0,
       "load_blocks":4.0,"candidates":3,"policy":"kv_aware"}

  Built only when asked for: a decision never pays for it otherwise.
- ``reported_cached_tokens``: the cached prompt tokens an engine's answer reports
  (``meta_info.cached_tokens``, or OpenAI's ``usage.prompt_tokens_details.cached_tokens``),
  read with one bytes search rather than a JSON parse of every answer.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from router.config import RouterConfig

if TYPE_CHECKING:
    from router.state import Pair

EXPLAIN_HEADER = "x-kvatlas-route"
ASK_HEADER = "x-kvatlas-explain"
_YES = frozenset(("1", "true", "yes", "on"))
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')


def wanted(headers: Mapping[str, str], config: RouterConfig) -> bool:
    """Whether this request's answer carries the explanation."""
    if config.explain_routes:
        return True
    value = headers.get(ASK_HEADER)
    return value is not None and value.strip().lower() in _YES


def explain(pair: Pair, config: RouterConfig, policy: str) -> str:
    """The header value for ``pair`` (compact JSON, ASCII)."""
    p, d = pair.prefill, pair.decode
    where = ({"worker": p.worker.instance_id} if d is None
             else {"prefill": p.worker.instance_id, "decode": d.worker.instance_id,
                   "pd_protocol": p.worker.protocol.label})
    doc: dict[str, Any] = {
        **where,
        "block_size": config.block_size, "prompt_blocks": p.prompt_blocks,
        "matched_blocks": p.matched_blocks, "index_blocks": p.indexed_blocks,
        "best_matched_blocks": p.best_matched}
    chosen = next((c for c in p.candidates if c.get("instance_id") == p.worker.instance_id),
                  None)
    if chosen is not None:
        credited = chosen.get("credited_blocks", p.matched_blocks)
        doc.update(tiers=chosen.get("index_tiers"), credited_blocks=credited,
                   cost=chosen.get("cost"),
                   missed_blocks=round(p.prompt_blocks - credited, 3),
                   overlap_weight=config.overlap_weight, load_blocks=chosen.get("load_blocks"))
    doc["candidates"] = len(p.candidates)
    doc["policy"] = policy
    if pair.why is not None:  # both shapes serve: the per-request choice and its costs
        doc["disaggregation"] = pair.why
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True)


def reported_cached_tokens(body: bytes) -> int:
    """The cached tokens ``body`` reports, summed over a batch's items (0: none reported)."""
    if b"cached_tokens" not in body:
        return 0
    return sum(int(m) for m in _CACHED.findall(body))


def last_cached_tokens(chunk: bytes, last: int) -> int:
    """A stream repeats its running ``cached_tokens`` in every event: keep the latest."""
    if b"cached_tokens" not in chunk:
        return last
    found = _CACHED.findall(chunk)
    return int(found[-1]) if found else last
