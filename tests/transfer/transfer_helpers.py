"""Helpers shared by the transfer tests: small layouts, seeded pools, connected sender/receiver pairs."""
from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    TensorPageSource,
    TransferConfig,
    create_receiver,
    create_sender,
)

SMALL = dict(num_layers=3, num_heads=4, head_dim=8, page_size=4)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def layout(tp_rank: int = 0, tp_size: int = 1, dtype: torch.dtype = torch.bfloat16,
           **over: int) -> KVLayout:
    return KVLayout.for_tp(**{**SMALL, **over}, dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)


def pool(lay: KVLayout, pages: int, seed: int | None) -> torch.Tensor:
    """Random KV (seeded) or, with seed None, a pool filled with a sentinel value."""
    if seed is None:
        return torch.full(lay.pool_shape(pages), -7.0, dtype=lay.torch_dtype)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.pool_shape(pages), generator=g, dtype=torch.float64).to(lay.torch_dtype)


def fast_config(**over: object) -> TransferConfig:
    return TransferConfig(**{"bootstrap_timeout_s": 10.0, "waiting_timeout_s": 10.0,
                             "connect_timeout_s": 2.0, **over})


class Rig:
    """Senders and receivers created for one test, closed at its end."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.senders: list[KVSender] = []
        self.receivers: list[KVReceiver] = []
        self.released: list[list[int]] = []

    async def sender(self, lay: KVLayout, src: torch.Tensor,
                     config: TransferConfig | None = None) -> KVSender:
        s = create_sender(self.backend, config or fast_config(), lay, TensorPageSource(src, lay))
        await s.start()
        self.senders.append(s)
        return s

    async def receiver(self, lay: KVLayout, dst: torch.Tensor,
                       config: TransferConfig | None = None) -> KVReceiver:
        r = create_receiver(self.backend, config or fast_config(), lay, dst,
                            release_pages=lambda ids: self.released.append(list(ids)))
        await r.start()
        self.receivers.append(r)
        return r

    async def close(self) -> None:
        for r in self.receivers:
            await r.close()
        for s in self.senders:
            await s.close()


def pages_of(t: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    return t[:, :, list(ids)]


async def spawn_sender(*args: str, key: str | None = None
                       ) -> tuple[asyncio.subprocess.Process, int]:
    """``sender_proc.py`` (a prefill rank in its own process) and its port; ``key`` goes into its
    environment as ``KVATLAS_TRANSFER_KEY``, the way a real prefill gets it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    env.pop("KVATLAS_TRANSFER_KEY", None)
    if key is not None:
        env["KVATLAS_TRANSFER_KEY"] = key
    proc = await asyncio.create_subprocess_exec(sys.executable, str(HERE / "sender_proc.py"), *args,
                                                stdout=asyncio.subprocess.PIPE, env=env)
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line.startswith(b"PORT "), line
    return proc, int(line.split()[1])


async def stop(proc: asyncio.subprocess.Process, receiver: KVReceiver) -> None:
    """End of a two-process test: close the decode side, then make sure the prefill is gone."""
    await receiver.close()
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
