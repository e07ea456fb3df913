"""A request whose worker vanishes mid-flight (its etcd record deleted, its lease expired) fails
saying so and naming the worker, not that the router is shutting down (real etcd, real stubs)."""
from __future__ import annotations

import asyncio
from typing import Any

from etcd_instances import wait_for

from router.config import RouterConfig


async def test_a_decode_whose_lease_expires_mid_request_is_named(
        start_router: Any, etcd_settings: Any, key_prefix: str, stubs: Any,
        register: Any) -> None:
    (p,), (d,) = await stubs("prefill"), await stubs("decode")
    client = await start_router(RouterConfig(etcd=etcd_settings, etcd_prefix=key_prefix,
                                             model="tiny", health_interval=60.0,
                                             retry_initial_backoff=0.005))
    await register("p0", {"role": "prefill", "model": "tiny", "url": p.url})
    dec = await register("d0", {"role": "decode", "model": "tiny", "url": d.url})

    async def ready() -> bool:
        return (await client.get("/readiness")).status == 200

    await wait_for(ready)
    # A first request leaves a keep-alive connection to the decode, which the next one reuses.
    assert (await client.post("/generate", json={"text": "warm"})).status == 200
    d.hold = asyncio.Event()
    pending = asyncio.ensure_future(client.post("/generate", json={"text": "in flight"}))

    async def decode_has_it() -> bool:
        return len(d.bodies) == 2

    await wait_for(decode_has_it)
    await dec.stop(revoke=True)  # the decode's lease ends: its record goes
    resp = await pending
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert "decode worker d0" in error and "vanished" in error, error
    assert "lease expired" in error and "shutting down" not in error, error
    d.hold.set()
