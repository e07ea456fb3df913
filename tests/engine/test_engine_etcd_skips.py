"""An engine's /metrics counts the etcd keys its process's watchers skipped as malformed (the
decode's prefill-restart watch here), by prefix kind and reason (real etcd, real engine app)."""
from __future__ import annotations

from typing import Any

import pytest
from waiting import wait_until

from engine.pd.restarts import PrefillRestarts
from engine.serve_config import EngineServerConfig
from engine.server import create_app
from index.etcd import EtcdClient
from index.follow import skipped_totals
from index.keys import KeyLayout, dumps

pytestmark = pytest.mark.timeout(60)


def _skipped(text: str, kind: str, reason: str) -> float:
    head = f'kvatlas_engine_etcd_values_skipped_total{{prefix_kind="{kind}",reason="{reason}"}}'
    for line in text.splitlines():
        if line.startswith(head):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _no_change(addr: str, reason: str) -> None:
    return None


async def test_the_engine_metrics_count_what_its_restart_watch_skipped(
        aiohttp_client: Any, etcd: EtcdClient, layout: KeyLayout) -> None:
    client = await aiohttp_client(create_app(EngineServerConfig()))
    before = _skipped(await (await client.get("/metrics")).text(), "instances", "bad_key")
    restarts = PrefillRestarts(etcd, layout, _no_change, progress_every=0.1)
    restarts.start()
    try:
        assert await restarts.wait_ready(10)
        # Not a key kvatlas writes (not UTF-8): the watch skips it and goes on.
        await etcd.put(layout.instances_prefix() + b"\xff\xfe-bad", dumps({"role": "prefill"}))
        await wait_until(lambda: skipped_totals().get(("instances", "bad_key"), 0) > before,
                         what="the restart watch to skip the non-UTF-8 instance key")
    finally:
        await restarts.close()
    text = await (await client.get("/metrics")).text()
    assert _skipped(text, "instances", "bad_key") > before, text
