"""cuda_ipc backend: the transport choice logic, a clean failure without CUDA, and (with a GPU) a
real two-process round trip that fails, never skips, when CUDA is present but IPC is broken."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transfer_helpers import fast_config, layout, pool

from transfer import TensorPageSource, TransferError, create_receiver, create_sender
from transfer.backends import cuda_ipc
from transfer.backends.cuda_ipc import BackendUnavailable, ModeChoice, select_mode

GOOD = dict(src_is_cuda=True, dst_is_cuda=True, same_host=True, ipc_ok=True)


@pytest.mark.parametrize("over, mode, reason", [
    ({}, "ipc", "same host"),
    ({"same_host": False}, "staged", "another host"),
    ({"dst_is_cuda": False}, "staged", "not on a GPU"),
    ({"ipc_ok": False, "ipc_why_not": "driver said no"}, "staged", "driver said no"),
    ({"src_is_cuda": False}, "bytes", "host memory"),
    ({"src_is_cuda": False, "same_host": False}, "bytes", "host memory"),
])
def test_auto_mode(over: dict, mode: str, reason: str) -> None:
    choice = select_mode(requested="auto", **{**GOOD, **over})
    assert choice.mode == mode and reason in choice.reason


def test_forced_modes() -> None:
    assert select_mode(requested="staged", **GOOD).mode == "staged"
    assert select_mode(requested="ipc", **GOOD) == ModeChoice("ipc", "same host, both pools on GPUs")
    with pytest.raises(TransferError, match="CUDA IPC was requested but is impossible: the decode "
                                            "rank is on another host"):
        select_mode(requested="ipc", **{**GOOD, "same_host": False})
    with pytest.raises(ValueError, match="mode must be one of"):
        select_mode(requested="nvlink", **GOOD)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path; this host has CUDA")
def test_clean_failure_without_cuda() -> None:
    ok, why = cuda_ipc.cuda_ipc_status()
    assert not ok and "no CUDA device" in why
    lay = layout()
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU.*use the zmq backend"):
        create_sender("cuda_ipc", fast_config(), lay, TensorPageSource(pool(lay, 2, 1), lay))
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        create_receiver("cuda_ipc", fast_config(), lay, pool(lay, 2, None))


def test_disable_env_blocks_ipc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_ipc.DISABLE_ENV, "1")
    assert cuda_ipc.cuda_ipc_status() == (False, f"{cuda_ipc.DISABLE_ENV} is set")


def test_device_checksum_detects_one_flipped_byte() -> None:
    lay = layout()
    tensors = [t.contiguous() for t in pool(lay, 3, 4)[0]]
    base = cuda_ipc.device_checksum(tensors)
    assert base == cuda_ipc.device_checksum([t.clone() for t in tensors])
    bad = [t.clone() for t in tensors]
    bad[1].view(torch.uint8).view(-1)[5] ^= 0x10
    assert cuda_ipc.device_checksum(bad) != base
    assert cuda_ipc.device_checksum(tensors[::-1]) != base  # buffer order matters


def test_unknown_backend() -> None:
    lay = layout()
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        create_receiver("rdma", fast_config(), lay, pool(lay, 2, None))


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False on this host, so the "
                           "CUDA IPC round trip cannot run here (wherever a GPU is visible it runs, "
                           "and a broken round trip fails)")
@pytest.mark.timeout(120)
async def test_cuda_ipc_round_trip_between_two_processes() -> None:
    """A GPU prefill rank in its own process hands IPC handles (MAC'd) to a GPU decode pool.

    Nothing here may turn a broken round trip into a skip: no IPC (driver or container refusal
    makes the sender fall back to ``staged``), a wrong byte, or an error all fail."""
    from transfer_helpers import pages_of, spawn_sender, stop

    from transfer.backends.cuda_ipc import CudaIpcReceiver

    key = "cuda-ipc-round-trip-key-0123456789"
    src_ids, dst_ids, room = [5, 1, 7, 2], [0, 6, 3, 4], 2 ** 62 + 3
    proc, port = await spawn_sender("--backend", "cuda_ipc", "--device", "cuda", "--pages", "8",
                                    "--seed", "23", "--rooms", str(room),
                                    "--src", ",".join(map(str, src_ids)), key=key)
    lay = layout()
    dst = pool(lay, 8, None).cuda()
    r = CudaIpcReceiver(fast_config(key=key), lay, dst)
    try:
        res = await asyncio.wait_for(r.receive(room, [f"tcp://127.0.0.1:{port}"], dst_ids), 60)
        sent = (await asyncio.wait_for(proc.stdout.readline(), 30)).split()
        assert sent == [b"SENT", str(room).encode(), b"ipc"], (
            f"the sender did not use CUDA IPC: {sent!r} (IPC refused between two processes on one "
            "host: check the container's IPC namespace and the driver)")
        assert res.num_pages == 4 and res.first_token == room % 1000
        assert torch.equal(pages_of(dst.cpu(), dst_ids), pages_of(pool(lay, 8, 23), src_ids))
        others = [p for p in range(8) if p not in dst_ids]
        assert bool((pages_of(dst.cpu(), others).float() == -7.0).all())
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc, r)
