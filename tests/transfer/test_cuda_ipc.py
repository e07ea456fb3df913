"""cuda_ipc backend on a machine without CUDA: clean failure, and the transport choice logic."""
from __future__ import annotations

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
