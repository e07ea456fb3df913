"""Prefill and decode in two processes over real loopback ZMQ, including a prefill killed mid-way."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import fast_config, layout, pages_of, pool, stop
from transfer_helpers import spawn_sender as spawn

from transfer import HeartbeatMonitor, TransferError, TransferState
from transfer.backends.zmq_backend import ZmqReceiver
from transfer.layout import DTYPES

pytestmark = pytest.mark.timeout(60)
KEY = "two-process-transfer-key-0123456789"


@pytest.mark.parametrize("dtype, key", [("bfloat16", None), ("float64", None), ("bfloat16", KEY)])
async def test_two_processes(dtype: str, key: str | None) -> None:
    src_ids, rooms = [9, 2, 3, 4, 15], [2 ** 63 - 5, 17]
    proc, port = await spawn("--dtype", dtype, "--seed", "11", "--rooms",
                             ",".join(map(str, rooms)), "--src", ",".join(map(str, src_ids)),
                             key=key)
    lay = layout(dtype=DTYPES[dtype])
    dst = pool(lay, 12, None)
    r = ZmqReceiver(fast_config(key=key), lay, dst)
    try:
        for i, room in enumerate(rooms):
            dst_ids = [i, 11 - i, 5, 6, 7]
            res = await asyncio.wait_for(r.receive(room, [f"tcp://127.0.0.1:{port}"], dst_ids), 30)
            assert (res.room, res.first_token, res.cached_tokens) == (room, room % 1000, 1)
            assert torch.equal(pages_of(dst, dst_ids), pages_of(pool(lay, 16, 11), src_ids))
            assert r.poll(room) is TransferState.SUCCESS
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc, r)


async def test_prefill_killed_mid_transfer_fails_within_heartbeat_window() -> None:
    proc, port = await spawn("--rooms", "77", "--src", "1,2", "--hang")
    cfg = fast_config(heartbeat_interval_s=0.2, heartbeat_max_misses=2)
    lay = layout()
    released: list[list[int]] = []
    r = ZmqReceiver(cfg, lay, pool(lay, 4, None), release_pages=lambda ids: released.append(ids))
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        rx = asyncio.create_task(r.receive(77, [endpoint], [0, 3]))
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).startswith(b"BOOTSTRAPPED")
        mon = HeartbeatMonitor.for_receiver(r, endpoint, cfg)
        assert await mon.beat()
        proc.kill()
        await proc.wait()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(mon.run(), 10)
        with pytest.raises(TransferError, match="declared dead"):
            await asyncio.wait_for(rx, 1)
        assert loop.time() - t0 <= cfg.heartbeat_deadline_s + 5.0  # generous for a loaded host
        assert released == [[0, 3]] and r.connected_peers() == []
    finally:
        await stop(proc, r)
