"""A decode instance's etcd record (role ``decode``, its HTTP url), kept under its own lease so
that routers find it and drop it when the instance dies."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from engine.pd.config import PDConfig
from engine.ranks.dist import RankInfo
from index.claim import ensure_id_free
from index.errors import EtcdError, InstanceIdInUse
from index.etcd import EtcdClient
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.owned import LeasedKeys
from index.record import DECODE, InstanceRecord

log = logging.getLogger(__name__)


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
    def __init__(self, cfg: PDConfig, info: RankInfo, served: dict[str, Any] | None = None
                 ) -> None:
        assert cfg.etcd is not None and cfg.instance_id is not None
        self.layout = KeyLayout(prefix=cfg.etcd_prefix)
        self.client = EtcdClient(cfg.etcd)
        self.session = LeaseSession(self.client, cfg.lease_ttl)
        self.keys = LeasedKeys(self.session, [])
        self.instance_id = cfg.instance_id
        self.key = self.layout.instance(cfg.instance_id)
        self.record = decode_record(cfg, info, served)
        self.keys.set(self.key, self.record.to_json())
        self._tasks: list[asyncio.Task[None]] = []

    async def claim(self) -> None:
        """Connect; InstanceIdInUse when a live process holds the id (etcd away: go on)."""
        try:
            await self.client.connect()
        except EtcdError as exc:
            log.warning("etcd not reachable at start, retrying: %s", exc)
            return
        try:
            await ensure_id_free(self.client, self.key, self.instance_id)
        except InstanceIdInUse:
            await self.client.close()
            raise

    async def start(self) -> None:
        """Publish the record (after ``claim``) and keep it under the lease."""
        self._tasks = [asyncio.create_task(self.session.run(), name="decode-lease"),
                       asyncio.create_task(self.keys.run(), name="decode-record")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await asyncio.wait_for(self.session.revoke(), 3.0)
        except (TimeoutError, EtcdError):
            log.warning("decode lease revoke failed; the record expires with the lease TTL")
        await self.client.close()
