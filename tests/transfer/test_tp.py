"""Different TP (and PP) sizes on prefill and decode: head shards gathered (D < P) or split (D > P)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import Rig, layout, pool

from transfer import KVLayout, TransferError

pytestmark = pytest.mark.timeout(30)


def targets(e: int, d: int, p: int) -> list[int]:
    """SGLang's decode -> prefill TP mapping (bootstrap/mapping.py implements it for the engine)."""
    if d == p:
        return [e]
    if d > p:
        return [e // (d // p)]
    return list(range(e * (p // d), (e + 1) * (p // d)))


@pytest.mark.parametrize("p, d", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (4, 1), (1, 4)])
async def test_tp_gather_and_split(rig: Rig, p: int, d: int) -> None:
    full = layout()
    g = pool(full, 12, seed=p * 10 + d)   # the model's KV over all heads
    room, src_ids = 4242, [3, 8, 9, 1]
    senders = []
    for rank in range(p):
        lay = layout(rank, p)
        senders.append(await rig.sender(lay, g[:, :, :, :, lay.heads[0]:lay.heads[1]].contiguous()))
    receivers, dsts, dst_ids = [], [], []
    for rank in range(d):
        lay = layout(rank, d)
        dsts.append(pool(lay, 10, seed=None))
        receivers.append(await rig.receiver(lay, dsts[-1]))
        dst_ids.append([rank, 9 - rank, 4, 5])
    for s in senders:
        s.create(room)
    rx = [asyncio.create_task(r.receive(room, [senders[t].endpoint for t in targets(e, d, p)],
                                        dst_ids[e])) for e, r in enumerate(receivers)]
    dests = await senders[0].wait_bootstrapped(room)
    # a prefill rank waits for all the decode ranks that read it: d/p of them when d > p
    assert sorted((x.dst_rank, x.heads) for x in dests) == [
        (e, layout(e, d).heads if d > p else layout(0, p).heads)
        for e in range(d) if 0 in targets(e, d, p)]
    await asyncio.gather(*(s.send(room, src_ids, first_token=7, cached_tokens=0) for s in senders))
    results = await asyncio.gather(*rx)
    for e in range(d):
        h0, h1 = layout(e, d).heads
        assert torch.equal(dsts[e][:, :, dst_ids[e]], g[:, :, src_ids, :, h0:h1])
        assert results[e].peers == tuple(senders[t].endpoint for t in targets(e, d, p))
        assert results[e].bytes_received == 4 * layout(e, d).page_bytes()

async def test_pp_layers_gathered_from_two_prefill_stages(rig: Rig) -> None:
    full = layout()
    g = pool(full, 6, seed=5)
    stages = [KVLayout.for_tp(num_layers=3, num_heads=4, head_dim=8, page_size=4, dtype="bfloat16",
                              layers=lr) for lr in ((0, 2), (2, 3))]
    senders = [await rig.sender(lay, g[lay.layers[0]:lay.layers[1]].contiguous()) for lay in stages]
    dst = pool(full, 6, seed=None)
    r = await rig.receiver(full, dst)
    for s in senders:
        s.create(8)
    await asyncio.gather(r.receive(8, [s.endpoint for s in senders], [0, 1]),
                         *(s.send(8, [4, 5], first_token=1, cached_tokens=0) for s in senders))
    assert torch.equal(dst[:, :, [0, 1]], g[:, :, [4, 5]])


async def test_one_shard_with_foreign_room_writes_nothing(rig: Rig) -> None:
    """D < P: one of the two prefill ranks answers with another room's KV; no shard is written."""
    g = pool(layout(), 6, seed=2)
    senders = []
    for rank in range(2):
        lay = layout(rank, 2)
        senders.append(await rig.sender(lay, g[:, :, :, :, lay.heads[0]:lay.heads[1]].contiguous()))
    senders[1].hooks.room_override[31] = 32
    dst = pool(layout(), 6, seed=None)
    r = await rig.receiver(layout(), dst)
    for s in senders:
        s.create(31)
    results = await asyncio.gather(r.receive(31, [s.endpoint for s in senders], [0, 1, 2]),
                                   *(s.send(31, [3, 4, 5], first_token=1, cached_tokens=0)
                                     for s in senders), return_exceptions=True)
    assert isinstance(results[0], TransferError)
    assert "bootstrap_room mismatch: expected 31, got 32" in str(results[0])
    assert results[0].peer == senders[1].endpoint
    assert bool((dst.float() == -7.0).all())
    assert rig.released == [[0, 1, 2]]


async def test_peers_must_cover_all_heads(rig: Rig) -> None:
    lay0 = layout(0, 2)
    s = await rig.sender(lay0, pool(lay0, 4, 1))
    r = await rig.receiver(layout(), pool(layout(), 4, None))
    with pytest.raises(TransferError, match="cover 6 of the 12"):
        await r.receive(40, [s.endpoint], [0])  # only half of the heads' prefill ranks named
    assert rig.released == [[0]]
