"""A decode instance's etcd record (role ``decode``, its HTTP url, whether it prefills a request
itself: ``local_prefill``), kept under its own lease so that routers find it and drop it when the
instance dies."""
from __future__ import annotations

from typing import Any

from engine.pd.config import PDConfig
from engine.ranks.dist import RankInfo
from engine.registration import LeasedRecord, engine_record
from index.record import DECODE, InstanceRecord


def decode_record(cfg: PDConfig, info: RankInfo, served: dict[str, Any] | None = None
                  ) -> InstanceRecord:
    """This decode's instance record (``served``: ``engine.registration.served_fields``, the
    tokenizer record and limits)."""
    assert cfg.instance_id is not None
    # a decode that prefills locally indexes its cache's blocks (hashed per page)
    more = {"block_size": cfg.engine.page_size} if cfg.caches_prefixes else {}
    more.update(cfg.protocol_fields(0, info.tp_size))  # a decode's names no endpoint
    return engine_record(cfg.engine, instance_id=cfg.instance_id, role=DECODE,
                         host=cfg.public_host, kv_cache_dtype=cfg.kv_dtype,
                         tp_size=info.tp_size, dp_size=info.dp_size, served=served,
                         local_prefill=cfg.local_prefill, **more)


class DecodeRecord(LeasedRecord):
    """The decode's record under its own lease (``LeasedRecord``)."""

    def __init__(self, cfg: PDConfig, info: RankInfo, served: dict[str, Any] | None = None
                 ) -> None:
        super().__init__(cfg.access, decode_record(cfg, info, served), name="decode")
