"""Transfer backends: ``zmq`` (real sockets), ``fake`` (in memory), ``cuda_ipc`` (GPU handles).

``create_sender`` / ``create_receiver`` pick one by name so that workers take it from a flag.
The cuda_ipc module is imported only when asked for, and raises ``BackendUnavailable`` without CUDA.
"""
from __future__ import annotations

from typing import Any

import torch

from transfer.backends.base import Destination, KVReceiver, KVSender, ReceiveResult, SenderHooks
from transfer.base import TransferConfig
from transfer.layout import KVLayout, PageSource

BACKENDS = ("zmq", "fake", "cuda_ipc")


def create_sender(kind: str, config: TransferConfig, layout: KVLayout, source: PageSource,
                  **kwargs: Any) -> KVSender:
    if kind == "zmq":
        from transfer.backends.zmq_backend import ZmqSender
        return ZmqSender(config, layout, source, **kwargs)
    if kind == "fake":
        from transfer.backends.fake import FakeSender
        return FakeSender(config, layout, source, **kwargs)
    if kind == "cuda_ipc":
        from transfer.backends.cuda_ipc import CudaIpcSender
        return CudaIpcSender(config, layout, source, **kwargs)
    raise ValueError(f"unknown transfer backend {kind!r}; choose one of {BACKENDS}")


def create_receiver(kind: str, config: TransferConfig, layout: KVLayout, pool: torch.Tensor,
                    **kwargs: Any) -> KVReceiver:
    if kind == "zmq":
        from transfer.backends.zmq_backend import ZmqReceiver
        return ZmqReceiver(config, layout, pool, **kwargs)
    if kind == "fake":
        from transfer.backends.fake import FakeReceiver
        return FakeReceiver(config, layout, pool, **kwargs)
    if kind == "cuda_ipc":
        from transfer.backends.cuda_ipc import CudaIpcReceiver
        return CudaIpcReceiver(config, layout, pool, **kwargs)
    raise ValueError(f"unknown transfer backend {kind!r}; choose one of {BACKENDS}")


__all__ = ["BACKENDS", "create_sender", "create_receiver", "KVSender", "KVReceiver",
           "ReceiveResult", "Destination", "SenderHooks"]
