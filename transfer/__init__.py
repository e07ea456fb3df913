"""KV data plane: a prefill rank's sender and a decode rank's receiver (see docs/architecture.md).

Imports nothing of kvatlas outside this package. How the workers use it:

Prefill rank (one sender per rank; its address goes into the bootstrap server's ``PUT /route``)::

    layout = KVLayout.for_tp(num_layers=..., num_heads=..., head_dim=..., page_size=...,
                             dtype=pool.dtype, tp_rank=tp_rank, tp_size=tp_size)
    sender = create_sender("zmq", TransferConfig(), layout, TensorPageSource(pool, layout))
    await sender.start()
    rank_ip, rank_port = sender.rank_address
    ...
    sender.create(room)                                   # on admission of a PD request
    await sender.send(room, page_ids, first_token=tok, cached_tokens=n)   # pages pinned until it returns

Decode rank (one receiver per rank; prefill endpoints come from the rank mapping)::

    receiver = create_receiver("zmq", TransferConfig(), layout, pool, release_pages=allocator.free)
    result = await receiver.receive(room, ["tcp://ip:port", ...], reserved_pages)
    monitor = HeartbeatMonitor.for_receiver(receiver, endpoint, config, probe=http_health_probe)

Failures raise :class:`TransferError` (room, reason, peer, stage, expected/actual, released pages).

Authentication: give every prefill and decode rank the same ``TransferConfig.key`` (a worker reads
it from ``$KVATLAS_TRANSFER_KEY`` through ``TransferConfig.from_cli_args``) and every message
carries a MAC (``transfer.auth``); without one, senders and receivers warn at start-up.
"""
from transfer.backends import (
                               BACKENDS,
                               Destination,
                               KVReceiver,
                               KVSender,
                               ReceiveResult,
                               SenderHooks,
                               create_receiver,
                               create_sender,
)
from transfer.base import InvalidTransition, TransferConfig, TransferError, TransferState, TransferStatus
from transfer.heartbeat import HeartbeatMonitor
from transfer.layout import KVLayout, PageSource, TensorPageSource

__all__ = ["BACKENDS", "Destination", "KVReceiver", "KVSender", "ReceiveResult", "SenderHooks",
           "create_receiver", "create_sender", "InvalidTransition", "TransferConfig",
           "TransferError", "TransferState", "TransferStatus", "HeartbeatMonitor", "KVLayout",
           "PageSource", "TensorPageSource"]
