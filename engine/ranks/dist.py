"""Rank processes of one PD instance under ``torch.distributed`` (gloo).

World layout: ``world = nnodes * ranks_per_node = dp * tp``; world rank ``w`` is DP rank
``w // tp`` and TP rank ``w % tp``. Every DP group's TP rank 0 leads it (drives the scheduler and
the other TP ranks step in lockstep); world rank 0 also serves HTTP and the bootstrap server.
Collectives used: one gloo group per DP group (per-layer all-gather of attention partials and the
leader's command broadcast) and the world group (start-up exchange of ports).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from engine.model import Combine, ordered_sum

logger = logging.getLogger(__name__)

#: Followers wait for the leader's next command without a deadline: an idle instance is fine.
IDLE_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True)
class RankInfo:
    world_rank: int
    world_size: int
    tp_size: int
    dp_size: int
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size != self.tp_size * self.dp_size:
            raise ValueError(f"world size {self.world_size} != tp {self.tp_size} * dp "
                             f"{self.dp_size}")
        if not 0 <= self.world_rank < self.world_size:
            raise ValueError(f"world rank {self.world_rank} outside world size {self.world_size}")

    @property
    def tp_rank(self) -> int:
        return self.world_rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.world_rank // self.tp_size

    @property
    def leader(self) -> int:
        """World rank of this DP group's leader (its TP rank 0)."""
        return self.dp_rank * self.tp_size

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def kv_heads(self, num_kv_heads: int) -> range:
        if num_kv_heads % self.tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over --tp {self.tp_size}; "
                             "pick a TP size that divides the model's KV heads")
        per = num_kv_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    @property
    def name(self) -> str:
        return f"dp{self.dp_rank}-tp{self.tp_rank}"


def local_world_ranks(world_size: int, nnodes: int, node_rank: int) -> list[int]:
    if world_size % nnodes:
        raise ValueError(f"{world_size} ranks cannot be split evenly over --nnodes {nnodes}")
    per = world_size // nnodes
    return list(range(node_rank * per, (node_rank + 1) * per))


class Dist:
    """The process groups of one rank (no-op stand-ins in a one-rank instance)."""

    def __init__(self, info: RankInfo, init_addr: str | None) -> None:
        self.info = info
        self.tp_group: Any = None
        if not info.distributed:
            return
        import torch.distributed as dist

        if init_addr is None:
            raise ValueError("a multi-rank instance needs --dist-init-addr HOST:PORT")
        dist.init_process_group("gloo", init_method=f"tcp://{init_addr}", rank=info.world_rank,
                                world_size=info.world_size, timeout=IDLE_TIMEOUT)
        # every rank must create every group, in the same order
        for dp in range(info.dp_size):
            ranks = list(range(dp * info.tp_size, (dp + 1) * info.tp_size))
            group = dist.new_group(ranks, timeout=IDLE_TIMEOUT, backend="gloo")
            if dp == info.dp_rank:
                self.tp_group = group

    def world_broadcast(self, obj: Any) -> Any:
        """World rank 0's ``obj`` on every rank (e.g. the leader's bootstrap port)."""
        if not self.info.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def world_gather(self, obj: Any) -> list[Any]:
        if not self.info.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(out, obj)
        return out

    def group_broadcast(self, obj: Any) -> Any:
        """The DP group leader's ``obj`` on every rank of the group."""
        if self.info.tp_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.info.leader, group=self.tp_group)
        return box[0]

    def combine(self) -> Combine:
        """The model's combine: gather every TP rank's per-head-group partials, add in head
        order (bit-identical to a one-rank model)."""
        if self.info.tp_size == 1:
            return ordered_sum
        import torch.distributed as dist

        group, tp = self.tp_group, self.info.tp_size

        def combine(parts: list[torch.Tensor]) -> torch.Tensor:
            mine = torch.stack(parts).contiguous()
            bufs = [torch.empty_like(mine) for _ in range(tp)]
            dist.all_gather(bufs, mine, group=group)
            return ordered_sum([p for b in bufs for p in b.unbind(0)])

        return combine

    def close(self) -> None:
        if self.info.distributed:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # tearing down after a peer died must not mask the real error
                logger.debug("destroy_process_group failed", exc_info=True)


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so no rank outlives its instance."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)
