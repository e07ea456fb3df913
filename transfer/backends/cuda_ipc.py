"""CUDA IPC backend: same-host GPU KV moves as CUDA IPC memory handles instead of bytes.

Control messages travel over the ZMQ backend's sockets. For each chunk, the prefill rank sends the
IPC handle of the (already contiguous) source tensors; the decode rank opens them (torch's own
``rebuild_cuda_tensor``, cached per storage, so the source pool is mapped once) and copies device to
device into its pool. When IPC is impossible (different host, a decode pool on the CPU, IPC
disabled or refused by the driver) the prefill stages each chunk through pinned host memory and
sends bytes, which any receiver accepts. :func:`select_mode` makes that choice and is pure, so it is
tested without a GPU.

Integrity: bytes payloads carry xxh3_64 (or, with a transfer key, the MAC) like the ZMQ backend.
IPC payloads never leave the GPU, so their checksum is ``dsum64``: a position-mixed wrap-around sum
of the int64 words of every buffer, computed on the device by both sides (a corruption check, not a
cryptographic one). With a key, the MAC covers the header, so the IPC handles and the dsum64 value
are authentic: the decode only opens memory that a key holder exported.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from transfer import wire
from transfer.backends._receiver_core import ReleasePages
from transfer.backends._sender_core import _Registration
from transfer.backends.zmq_backend import ZmqReceiver, ZmqSender
from transfer.base import TransferConfig, TransferError, TransferLayerError
from transfer.layout import KVLayout, PageSource, dtype_from_name, dtype_name, tensor_bytes

CHECKSUM_DSUM = "dsum64"
DISABLE_ENV = "KVATLAS_DISABLE_CUDA_IPC"
MODES = ("auto", "ipc", "staged")
KEEP_OPENED = 4
#: Chunk size towards a decode that gets IPC handles. Bytes chunks stay small (``chunk_bytes``: the
#: decode checksums and writes one while the next is on the wire), but an IPC chunk carries no bytes,
#: only handles, and costs a fixed ~0.7 ms (export, checksum, open, message) whatever its size: at
#: 2 MiB chunks the H200 moved 2.8 GB/s against a 2 TB/s device copy.
IPC_CHUNK_BYTES = 256 << 20


class BackendUnavailable(TransferLayerError, RuntimeError):
    """This backend cannot run on this machine; the message says what to use instead."""


@dataclass(frozen=True)
class ModeChoice:
    mode: str
    """``ipc`` (handles), ``staged`` (GPU -> pinned host -> bytes) or ``bytes`` (CPU source)."""
    reason: str


def select_mode(*, requested: str, src_is_cuda: bool, dst_is_cuda: bool, same_host: bool,
                ipc_ok: bool, ipc_why_not: str = "") -> ModeChoice:
    """How one chunk travels from a prefill rank to one decode rank."""
    if requested not in MODES:
        raise ValueError(f"cuda_ipc mode must be one of {MODES}, got {requested!r}")
    if not src_is_cuda:
        return ModeChoice("bytes", "the prefill KV is in host memory")
    blockers = []
    if not ipc_ok:
        blockers.append(ipc_why_not or "CUDA IPC is not available here")
    if not same_host:
        blockers.append("the decode rank is on another host (or another boot)")
    if not dst_is_cuda:
        blockers.append("the decode pool is not on a GPU")
    if requested == "staged":
        return ModeChoice("staged", "staging through pinned host memory was requested")
    if blockers:
        if requested == "ipc":
            raise TransferError(None, "CUDA IPC was requested but is impossible: "
                                + "; ".join(blockers) + "; use mode 'auto' or 'staged'")
        return ModeChoice("staged", "; ".join(blockers))
    return ModeChoice("ipc", "same host, both pools on GPUs")


def cuda_ipc_status() -> tuple[bool, str]:
    """(usable, why not). Probes sharing a tiny tensor, because containers and some drivers
    refuse IPC even when CUDA works."""
    if os.environ.get(DISABLE_ENV):
        return False, f"{DISABLE_ENV} is set"
    if not torch.cuda.is_available():
        return False, (f"no CUDA device (torch {torch.__version__}, built with CUDA "
                       f"{torch.version.cuda})")
    try:
        torch.empty(1, device="cuda").untyped_storage()._share_cuda_()
    except RuntimeError as e:
        return False, f"the driver refused to export an IPC handle: {e}"
    return True, ""


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            f"the cuda_ipc transfer backend needs a CUDA GPU, but torch {torch.__version__} sees "
            f"none (torch.version.cuda={torch.version.cuda}); use the zmq backend on this machine")


def device_checksum(tensors: list[torch.Tensor]) -> int:
    """dsum64 over ``tensors`` on their device (see the module docstring).

    The per-buffer sums stay on the device and come back in one transfer: one synchronization per
    chunk, not one per buffer (a chunk of IPC handles holds dozens of buffers)."""
    if not tensors:
        return 0
    sums = []
    for t in tensors:
        flat = t.reshape(-1).view(torch.uint8)
        words = flat.view(torch.int64) if flat.numel() % 8 == 0 else flat.to(torch.int64)
        sums.append(words.sum())
    acc = 0
    for i, s in enumerate(torch.stack([s.to(sums[0].device) for s in sums]).tolist()):
        acc = (acc * 0x100000001B3 + (s & 0xFFFFFFFFFFFFFFFF) + i + 1) & 0xFFFFFFFFFFFFFFFF
    return acc


def _handle(t: torch.Tensor) -> list[Any]:
    (device, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
     event_sync) = t.untyped_storage()._share_cuda_()
    return [list(t.shape), list(t.stride()), t.storage_offset(), dtype_name(t.dtype), device,
            handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync]


def _open_handle(h: list[Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (shape, stride, offset, dtype, device, handle, size_bytes, offset_bytes, ref_handle, ref_offset,
     event_handle, event_sync) = h
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(stride), offset,
                               torch.storage.TypedStorage, dtype_from_name(dtype), device, handle,
                               size_bytes, offset_bytes, False, ref_handle, ref_offset,
                               event_handle, event_sync)


class CudaIpcSender(ZmqSender):
    """A ZMQ sender whose GPU chunks go as IPC handles (or pinned-host bytes as the fallback)."""

    def __init__(self, config: TransferConfig, layout: KVLayout, source: PageSource, *,
                 host: str = "127.0.0.1", port: int = 0, mode: str = "auto",
                 device: str = "cuda") -> None:
        require_cuda()
        select_mode(requested=mode, src_is_cuda=False, dst_is_cuda=False, same_host=False,
                    ipc_ok=False)  # validates ``mode``
        super().__init__(config, layout, source, host=host, port=port, device=device)
        self.mode = mode
        self.ipc_ok, self.ipc_why_not = cuda_ipc_status()
        self.choices: dict[str, ModeChoice] = {}

    async def _on_register(self, conn: Any, msg: wire.Register) -> None:
        before = self._regs.get(conn)
        await super()._on_register(conn, msg)
        reg = self._regs.get(conn)
        if reg is None or reg is before:  # refused
            return
        # Only where the chunks will surely be IPC: a bytes chunk this large would exceed the
        # decode's message limit. A source that does not show its pool keeps the small chunks.
        pool = getattr(self.source, "pool", None)
        if not isinstance(pool, torch.Tensor):
            return
        try:
            mode = select_mode(requested=self.mode, src_is_cuda=pool.is_cuda,
                               dst_is_cuda=reg.device.startswith("cuda"),
                               same_host=bool(reg.host_id) and reg.host_id == self.host_id,
                               ipc_ok=self.ipc_ok, ipc_why_not=self.ipc_why_not).mode
        except TransferError:
            return  # mode 'ipc' that cannot be: the first chunk fails with the reason
        if mode == "ipc":
            reg.chunk_bytes = max(reg.chunk_bytes, IPC_CHUNK_BYTES)

    def _encode_payload(self, reg: _Registration, tensors: list[torch.Tensor]
                        ) -> tuple[dict[str, Any], list[Any], list[Any]]:
        choice = select_mode(requested=self.mode, src_is_cuda=bool(tensors) and tensors[0].is_cuda,
                             dst_is_cuda=reg.device.startswith("cuda"),
                             same_host=bool(reg.host_id) and reg.host_id == self.host_id,
                             ipc_ok=self.ipc_ok, ipc_why_not=self.ipc_why_not)
        self.choices[reg.peer] = choice
        if choice.mode == "bytes":
            return super()._encode_payload(reg, tensors)
        if choice.mode == "staged":
            # one pinned allocation per chunk (cudaHostAlloc is slow), viewed per buffer
            total = sum(t.numel() for t in tensors)
            staging = torch.empty(total, dtype=tensors[0].dtype, pin_memory=True)
            host, offset = [], 0
            for t in tensors:
                h = staging[offset:offset + t.numel()].view(t.shape)
                h.copy_(t, non_blocking=True)
                host.append(h)
                offset += t.numel()
            torch.cuda.current_stream(tensors[0].device).synchronize()
            buffers = [tensor_bytes(h) for h in host]
            return self._bytes_checksum(buffers), buffers, [staging]
        # The gathers that produced ``tensors`` run asynchronously: finish them before a peer reads.
        torch.cuda.current_stream(tensors[0].device).synchronize()
        return ({"checksum": device_checksum(tensors), "checksum_algo": CHECKSUM_DSUM,
                 "payload": "cuda_ipc", "ipc": [_handle(t) for t in tensors]}, [], tensors)


class CudaIpcReceiver(ZmqReceiver):
    """A ZMQ receiver that also accepts IPC-handle chunks into a GPU pool."""

    def __init__(self, config: TransferConfig, layout: KVLayout, pool: torch.Tensor, *,
                 receiver_id: str | None = None, release_pages: ReleasePages | None = None) -> None:
        require_cuda()
        if pool.device.type != "cuda":
            raise BackendUnavailable(f"the cuda_ipc receiver needs its KV pool on a GPU, got "
                                     f"{pool.device}; use the zmq backend for a host pool")
        super().__init__(config, layout, pool, receiver_id=receiver_id, release_pages=release_pages)
        # Opening an IPC handle costs a driver call; chunks of one transfer usually share the
        # prefill pool's storage, so the last few opened storages are kept mapped.
        self._opened: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def _payload_tensors(self, endpoint: str, msg: wire.Pages) -> tuple[int, list[torch.Tensor]]:
        if msg.payload != "cuda_ipc":
            return super()._payload_tensors(endpoint, msg)
        if msg.checksum_algo != CHECKSUM_DSUM or len(msg.ipc) != msg.num_buffers:
            raise TransferError(msg.room, f"bad cuda_ipc chunk: {len(msg.ipc)} handles, checksum "
                                f"{msg.checksum_algo!r}", peer=endpoint)
        try:
            tensors = []
            for h in msg.ipc:
                t = _open_handle(list(h))
                self._opened[bytes(h[5])] = t
                self._opened.move_to_end(bytes(h[5]))
                tensors.append(t)
            while len(self._opened) > KEEP_OPENED:
                self._opened.popitem(last=False)
        except (RuntimeError, ValueError, TypeError) as e:
            raise TransferError(msg.room, f"could not open the prefill's CUDA IPC handle ({e}); "
                                "set the sender's mode to 'staged' if IPC is blocked between these "
                                "processes", peer=endpoint) from None
        return device_checksum(tensors), tensors
