"""Heartbeat misses: a dead prefill rank fails its in-flight transfers and loses its connection."""
from __future__ import annotations

import asyncio

import pytest
from transfer_helpers import Rig, fast_config, layout, pool

from transfer import HeartbeatMonitor, TransferError

pytestmark = pytest.mark.timeout(30)


async def test_custom_probe_declares_dead_after_max_misses() -> None:
    answers = iter([True, False, True, False, False, True])
    dead: list[str] = []

    async def probe() -> bool:
        return next(answers)

    cfg = fast_config(heartbeat_interval_s=0.01, heartbeat_max_misses=2)
    mon = HeartbeatMonitor("prefill-0", probe, dead.append, cfg)
    await asyncio.wait_for(mon.run(), 5)
    assert mon.dead and len(dead) == 1 and "2 consecutive heartbeats missed" in dead[0]
    assert await mon.beat() is False  # stays dead, probe not called again
    assert next(answers) is True


async def test_probe_errors_and_hangs_count_as_misses() -> None:
    calls = 0

    async def probe() -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("connection refused")
        await asyncio.sleep(10)
        return True

    dead: list[str] = []
    mon = HeartbeatMonitor("x", probe, dead.append,
                           fast_config(heartbeat_interval_s=0.05, heartbeat_max_misses=2))
    await asyncio.wait_for(mon.run(), 5)
    assert "no answer within 0.05 s" in dead[0] and calls == 2


async def test_dead_prefill_fails_in_flight_transfer(rig: Rig) -> None:
    cfg = fast_config(heartbeat_interval_s=0.1, heartbeat_max_misses=2)
    lay = layout()
    s, r = await rig.sender(lay, pool(lay, 4, 1)), await rig.receiver(lay, pool(lay, 4, None), cfg)
    s.create(50)
    rx = asyncio.create_task(r.receive(50, [s.endpoint], [0, 1]))
    await s.wait_bootstrapped(50)
    mon = HeartbeatMonitor.for_receiver(r, s.endpoint, cfg)
    assert await mon.beat() is True  # a real round trip over the data plane
    await s._shutdown()  # the prefill rank dies mid-transfer: its socket vanishes, no abort sent
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(mon.run(), 5)
    with pytest.raises(TransferError, match="declared dead: 2 consecutive heartbeats missed"):
        await rx
    assert loop.time() - t0 < cfg.heartbeat_deadline_s + 5.0  # generous: a loaded 2-core box
    await asyncio.sleep(0.05)
    assert r.connected_peers() == [] and rig.released == [[0, 1]]
