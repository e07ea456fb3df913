"""A decode instance's etcd record (role ``decode``, its HTTP url), kept under its own lease so
that routers find it and drop it when the instance dies."""
from __future__ import annotations

import logging
import time
from typing import Any

from engine.pd.config import PDConfig
from engine.ranks.dist import RankInfo
from index.etcd import EtcdClient
from index.presence import Claim, InstancePresence
from index.record import DECODE, InstanceRecord

logger = logging.getLogger(__name__)


def decode_record(cfg: PDConfig, info: RankInfo, served: dict[str, Any] | None = None
                  ) -> InstanceRecord:
    """This decode's instance record (``started_at``: now, a new value per process;
    ``served``: ``engine.pd.common.served_fields``, the tokenizer record and limits)."""
    assert cfg.instance_id is not None
    e = cfg.engine
    return InstanceRecord(
        instance_id=cfg.instance_id, role=DECODE, model=e.model_name,
        url=f"http://{cfg.public_host}:{e.port}", tp_size=info.tp_size, dp_size=info.dp_size,
        page_size=e.page_size, kv_cache_dtype=cfg.kv_dtype, ready=True, started_at=time.time(),
        **(served or {}))


class DecodeRecord:
    """The record under its own ``InstancePresence``: ``claim()`` first (before anything runs
    that a refusal would have to stop), ``start()`` once serving, ``close()`` at the end."""

    def __init__(self, cfg: PDConfig, info: RankInfo, served: dict[str, Any] | None = None
                 ) -> None:
        assert cfg.etcd is not None and cfg.instance_id is not None
        self.layout = cfg.access.layout
        self.instance_id = cfg.instance_id
        self.key = self.layout.instance(cfg.instance_id)
        self.presence = InstancePresence(EtcdClient(cfg.etcd), cfg.lease_ttl,
                                         claim=Claim(self.key, cfg.instance_id), name="decode")
        self.client = self.presence.client
        self.record = decode_record(cfg, info, served)
        self.presence.keys.set(self.key, self.record.to_json())

    async def claim(self) -> None:
        """Connect; InstanceIdInUse when a live process holds the id (etcd away: go on)."""
        await self.presence.claim()

    async def start(self) -> None:
        """Publish the record (after ``claim``) and keep it under the lease."""
        self.presence.start()

    async def close(self) -> None:
        await self.presence.close()
