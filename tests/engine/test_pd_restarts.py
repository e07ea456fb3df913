"""The decode notices a prefill restarted under the same address from its etcd instance record
(real etcd): a new ``started_at`` names the bootstrap address, also when the old record expired
first; updates of the same process (ranks registering, ready flips) and a lone delete do not."""
from __future__ import annotations

import asyncio

import pytest
from engine_helpers import wait_until
from etcd_fakes import HeldWatchClient

from engine.pd.restarts import PrefillRestarts
from index.etcd import EtcdClient, EtcdSettings
from index.keys import KeyLayout, dumps

pytestmark = pytest.mark.timeout(120)


def _record(started_at: float, ready: bool = True, role: str = "prefill") -> bytes:
    return dumps({"instance_id": "p0", "role": role, "url": "http://127.0.0.1:1",
                  "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998,
                  "started_at": started_at, "ready": ready})


async def test_new_process_and_vanished_record_are_reported(etcd: EtcdClient,
                                                           layout: KeyLayout) -> None:
    seen: list[tuple[str, str]] = []

    async def on_change(addr: str, reason: str) -> None:
        seen.append((addr, reason))

    key = layout.instance("p0")
    await etcd.put(key, _record(1.0))
    await etcd.put(layout.instance("d0"), _record(1.0, role="decode"))
    watch = PrefillRestarts(etcd, layout, on_change, progress_every=0.5)
    task = asyncio.create_task(watch.run())

    async def until(n: int) -> None:
        # a deadline far past any etcd round trip: only a change never reported reaches it
        await wait_until(lambda: len(seen) >= n, f"{n} restarts reported (seen {seen})", 30.0)

    try:
        await wait_until(lambda: key in watch.known, "the record known to the watch", 30.0)
        await etcd.put(key, _record(1.0, ready=False))  # same process: not a restart
        await etcd.put(layout.instance("d0"), _record(2.0, role="decode"))  # decodes: ignored
        await etcd.put(key, _record(2.0))  # a new process under the same id
        await until(1)
        assert seen[0][0] == "127.0.0.1:8998" and "new process" in seen[0][1]
        await etcd.delete(key)  # lease expired: maybe only etcd trouble, not acted on
        rev = await etcd.put(key, _record(2.0))  # the same process publishes again
        assert await watch.wait_revision(rev, 30.0), "the watch never applied the put"
        assert len(seen) == 1
        await etcd.delete(key)
        await etcd.put(key, _record(3.0))  # a new process after the old record expired
        await until(2)
        assert seen[1][0] == "127.0.0.1:8998" and "new process" in seen[1][1]
        # Reported once: by the time a later (ignored) put is applied, nothing more came.
        rev = await etcd.put(layout.instance("d0"), _record(3.0, role="decode"))
        assert await watch.wait_revision(rev, 30.0), "the watch never applied the put"
        assert len(seen) == 2 and watch.changes == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_restart_behind_a_silent_watch_is_still_reported(
        etcd: EtcdClient, etcd_settings: EtcdSettings, layout: KeyLayout) -> None:
    seen: list[tuple[str, str]] = []

    async def on_change(addr: str, reason: str) -> None:
        seen.append((addr, reason))

    key = layout.instance("p0")
    await etcd.put(key, _record(1.0))
    client = HeldWatchClient(etcd_settings)
    await client.connect()
    watch = PrefillRestarts(client, layout, on_change, progress_every=0.2)
    task = asyncio.create_task(watch.run())
    try:
        await wait_until(lambda: key in watch.known, "the record known to the watch", 30.0)
        client.held = True
        await etcd.put(key, _record(2.0))  # never delivered by the stream
        await wait_until(lambda: len(seen) >= 1, f"the restart reported (seen {seen})", 15.0)
        assert seen[0][0] == "127.0.0.1:8998" and "while disconnected" in seen[0][1]
        client.held = False  # the stream delivers again: the watch itself reports the next one
        await wait_until(lambda: watch.connected, "connected once the stream delivers", 15.0)
        await etcd.put(key, _record(3.0))
        await wait_until(lambda: len(seen) >= 2, f"the next restart reported (seen {seen})", 15.0)
        assert "under the same id" in seen[1][1] and watch.changes == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()
