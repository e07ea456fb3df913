"""One decode rank fetching one room's KV: resolve the prefill's topology and the ranks this rank
reads, connect, receive (room and checksum validated before any page is written).

Each step names the stage it belongs to, so a failure says where it stopped and which rank was
involved. Topologies and rank addresses are cached per bootstrap address by the client.

Cached state can be stale: a prefill restarted on the same address has new ranks that know none
of this decode's registrations. When resolving or connecting fails while state for the address
was cached, that state is dropped and the room resolved once more before the request fails.
(A failure inside ``receive`` is not retried: the receiver takes a room only once, and the
room's KV may already be partly written.)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bootstrap.client import BootstrapClient
from bootstrap.errors import BootstrapError, TopologyMismatch
from bootstrap.mapping import DecodeParallel
from engine.errors import EngineError
from engine.pd.common import Bootstrap
from engine.pd.config import PDConfig
from engine.ranks.dist import RankInfo
from transfer import KVReceiver, ReceiveResult, TransferError

logger = logging.getLogger(__name__)

OnStage = Callable[[str, dict[str, Any]], None]


class FetchError(EngineError):
    """Fetching a room's KV failed at ``stage`` on decode rank ``rank`` (``peer``: the prefill
    rank or bootstrap address involved)."""

    def __init__(self, room: int, stage: str, rank: str, reason: str,
                 peer: str | None = None) -> None:
        where = f" (prefill {peer})" if peer else ""
        super().__init__(f"room {room}: failed at stage {stage} on decode rank {rank}{where}: "
                         f"{reason}")
        self.room, self.stage, self.rank, self.reason, self.peer = room, stage, rank, reason, peer

    def doc(self) -> dict[str, Any]:
        return {"stage": self.stage, "rank": self.rank, "peer": self.peer, "reason": self.reason,
                "message": str(self)}


@dataclass
class DecodeRank:
    """What one decode rank needs to fetch KV."""

    cfg: PDConfig
    info: RankInfo
    receiver: KVReceiver
    client: BootstrapClient
    endpoints: dict[str, set[str]] = field(default_factory=dict)
    """Prefill rank endpoints this rank connected to, per bootstrap address."""
    retries: int = 0
    """Rooms resolved a second time after cached state for their prefill failed."""

    @property
    def rank(self) -> str:
        return f"tp{self.info.tp_rank}"

    async def fetch(self, boot: Bootstrap, pages: list[int], on_stage: OnStage | None = None,
                    guard: Callable[[], str | None] | None = None) -> ReceiveResult:
        """Fetch ``boot.room`` into ``pages``; ``guard`` (checked right before the receive
        starts) returns a reason when the room was aborted meanwhile."""
        cached = (self.client.cached_topology(boot.host, boot.port) is not None
                  or boot.addr in self.endpoints)
        try:
            return await self._fetch_once(boot, pages, on_stage, guard)
        except FetchError as exc:
            if not cached or exc.stage == "verified":
                raise
            logger.info("room %s: %s with cached state for prefill %s; re-resolving once",
                     boot.room, exc.reason, boot.addr)
            self.drop(boot.addr)
            self.retries += 1
            await asyncio.sleep(0)  # the receiver forgets the dropped peers in a task of its own
            return await self._fetch_once(boot, pages, on_stage, guard)

    async def _fetch_once(self, boot: Bootstrap, pages: list[int], on_stage: OnStage | None,
                          guard: Callable[[], str | None] | None) -> ReceiveResult:
        note = on_stage or (lambda stage, info: None)
        stage, peer = "resolved_topology", boot.addr
        try:
            topo, mapping = await self.client.get_mapping(
                boot.host, boot.port, DecodeParallel(self.info.tp_size, self.info.tp_rank),
                page_size=self.cfg.engine.page_size, kv_cache_dtype=self.cfg.kv_dtype)
            note(stage, {"prefill_tp": topo.attn_tp_size, "prefill_dp": topo.dp_size})
            stage = "resolved_ranks"
            dp = await self._prefill_dp(boot)
            addrs = await self.client.get_rank_addresses(boot.host, boot.port, mapping, dp)
            eps = [a.tcp_endpoint for a in addrs.values()]
            note(stage, {"prefill_dp_rank": dp, f"{self.rank}_reads": eps})
            stage = "connected"
            for ep in eps:
                peer = ep
                await self.receiver.connect(ep)
            self.endpoints.setdefault(boot.addr, set()).update(eps)
            note(stage, {})
            stage, peer = "verified", ",".join(eps)
            aborted = guard() if guard is not None else None
            if aborted is not None:  # no await between this check and receive() registering
                raise TransferError(boot.room, f"aborted by the decode leader: {aborted}")
            result = await self.receiver.receive(boot.room, eps, pages)
            note(stage, {"first_token": result.first_token,
                         "cached_tokens": result.cached_tokens})
            return result
        except TopologyMismatch as exc:
            raise FetchError(boot.room, stage, self.rank, str(exc), boot.addr) from None
        except TransferError as exc:
            raise FetchError(boot.room, stage, self.rank, str(exc), exc.peer or peer) from None
        except BootstrapError as exc:
            raise FetchError(boot.room, stage, self.rank, str(exc), boot.addr) from None
        except ValueError as exc:  # the mapping refused the sizes
            raise FetchError(boot.room, stage, self.rank, str(exc), boot.addr) from None

    async def _prefill_dp(self, boot: Bootstrap) -> int:
        """The prefill DP rank of the room; polls while a round-robin prefill has not announced
        it yet (it does so before it starts the prefill)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.transfer.waiting_timeout_s
        while True:
            dp = await self.client.prefill_dp(boot.host, boot.port, boot.room)
            if dp is not None:
                return dp
            if loop.time() > deadline:
                raise TransferError(boot.room, "the prefill never announced a DP rank for this "
                                    "room (/query_dp_ranks)")
            await asyncio.sleep(0.01)

    def drop(self, addr: str) -> None:
        """Forget the cached topology and ranks of bootstrap ``addr``; its connections are
        registered again on next use (rooms in flight on them fail: that process is gone)."""
        self.fail_prefill(addr, f"cached state of prefill {addr} was stale")

    def fail_prefill(self, addr: str, reason: str) -> list[int]:
        """The prefill instance at bootstrap ``addr`` is gone: fail its rooms here, drop the
        cached topology, ranks and connections."""
        failed: list[int] = []
        for ep in self.endpoints.pop(addr, set()):
            failed += self.receiver.fail_peer(ep, reason)
        host, _, port = addr.rpartition(":")
        self.client.forget(host, int(port))
        return failed
