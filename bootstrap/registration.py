"""A rank's registration with its instance's bootstrap server: the client end of ``PUT /route``
(the server end is ``bootstrap.server.route_put``). Plain arguments only, so that any engine (ours
or another) can register its ranks."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

logger = logging.getLogger(__name__)

PUT_TRIES = 5


def route_body(*, tp_size: int, tp_rank: int, dp_size: int, dp_rank: int, rank_ip: str,
               rank_port: int, page_size: int, kv_cache_dtype: str, load_balance_method: str,
               prefill_http_port: int | None) -> dict[str, Any]:
    """SGLang 0.5.23's registration fields for one rank (``prefill_http_port``: the instance's
    HTTP port, world rank 0's)."""
    return {
        "attn_tp_size": tp_size, "attn_tp_rank": tp_rank,
        "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": dp_size, "attn_dp_rank": dp_rank,
        "pp_size": 1, "pp_rank": 0, "system_dp_size": 1, "system_dp_rank": 0,
        "rank_ip": rank_ip, "rank_port": rank_port,
        "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
        "kv_layout": None, "dsv41_spec_layout": None,
        "load_balance_method": load_balance_method,
        "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False,
        "prefill_http_port": prefill_http_port, "decode_allocation_policy": "early",
    }


async def put_route(bootstrap_url: str, body: dict[str, Any], tries: int = PUT_TRIES,
                    first_delay: float = 0.2, token: str | None = None) -> None:
    """``PUT /route``, retried ``tries`` times with doubling backoff (the server may still be
    starting on node 0); ``token``: the bootstrap write token, sent as a bearer token. Raises
    RuntimeError naming the last failure."""
    delay, last = first_delay, ""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for attempt in range(1, tries + 1):
            try:
                async with session.put(f"{bootstrap_url}/route", json=body,
                                       headers=headers) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}: {text[:200]}"
                    if 400 <= resp.status < 500:
                        break  # a refused registration does not heal by retrying
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            logger.info("PUT %s/route try %d/%d failed: %s", bootstrap_url, attempt, tries, last)
            if attempt < tries:
                await asyncio.sleep(delay)
                delay *= 2
    hint = ("; check that every rank of the instance got the same --auth-token"
            if last.startswith("HTTP 401") else "; check --bootstrap-port and that node 0 is up")
    raise RuntimeError(f"rank could not register with the bootstrap server {bootstrap_url}: "
                       f"{last}{hint}")
