"""A monolithic engine as an ``aggregated`` instance of a cluster (``kvatlas engine serve
--mode monolithic --etcd ...``): it serves whole requests (no PD pair), so routers find it by
its instance record, and its prefix cache's blocks are in the block index under its lease.

The same parts as a PD engine's: the record is ``engine.registration.engine_record`` kept by a
``LeasedRecord`` (an ``index.presence.InstancePresence``), and the prefix cache's KV events go
in process through an ``EventFeed`` into ``index.pipeline.open_block_pipeline``, as a PD
prefill's leader feeds its own. At a stop the lease is revoked: record and blocks vanish.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.registration import (
    LeasedRecord,
    check_advertise_host,
    engine_record,
    index_blocks,
    public_host,
    served_fields,
)
from engine.serve_config import EngineServerConfig
from index.access import ClusterAccess
from index.events.types import KVEvent
from index.keys import validate_instance_id
from index.record import AGGREGATED, InstanceRecord

logger = logging.getLogger(__name__)


@dataclass
class AggregatedConfig:
    """One monolithic engine registered in etcd as an ``aggregated`` instance. Its flags are
    the ones PD instances take (``--etcd``..., ``--instance-id``, ``--advertise-host``,
    ``--lease-ttl``), so ``from_cli_args`` reads them and adds none."""

    engine: EngineServerConfig
    """The engine (``mode`` monolithic)."""
    access: ClusterAccess
    """The cluster: etcd (required), key prefix, index shards and the lease TTL of the record
    and the blocks."""
    instance_id: str | None = None
    """Instance id in etcd (default: ``aggregated-`` and 8 random hex digits)."""
    advertise_host: str | None = None
    """The host routers dial (the record's ``url``); default: ``--host``, or this machine's
    name when ``--host`` is a wildcard."""

    def __post_init__(self) -> None:
        if self.engine.mode != "monolithic":
            raise ValueError(f"an aggregated instance runs --mode monolithic, not "
                             f"{self.engine.mode!r}")
        if self.access.etcd is None:
            raise ValueError("an aggregated instance needs --etcd (where its record and "
                             "blocks are written)")
        if self.engine.kv_events is not None:
            raise ValueError("--kv-events and --etcd exclude each other: with --etcd the engine "
                             "indexes its own blocks in etcd; --kv-events publishes them for a "
                             "sidecar (kvatlas sidecar) and needs no etcd")
        check_advertise_host(self.advertise_host)
        if self.instance_id is None:
            self.instance_id = f"{AGGREGATED}-{uuid.uuid4().hex[:8]}"
        validate_instance_id(self.instance_id)

    @property
    def public_host(self) -> str:
        return public_host(self.engine.host, self.advertise_host)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, engine: EngineServerConfig
                      ) -> AggregatedConfig | None:
        """From the flags; None without ``--etcd`` (the engine serves alone, as before)."""
        access = ClusterAccess.from_cli_args(args, optional=True, lease_ttl=args.lease_ttl)
        if access.etcd is None:
            return None
        return cls(engine=engine, access=access, instance_id=args.instance_id,
                   advertise_host=args.advertise_host)

    def record(self, tokenizer: Any, ready: bool) -> InstanceRecord:
        """This instance's record (``tokenizer``: the engine's, for the served fields)."""
        assert self.instance_id is not None
        e = self.engine
        return engine_record(e, instance_id=self.instance_id, role=AGGREGATED,
                             host=self.public_host, kv_cache_dtype=e.model_config.dtype,
                             ready=ready, served=served_fields(e, tokenizer),
                             block_size=e.page_size)


AGGREGATED_KEY = web.AppKey("aggregated", AggregatedConfig)


class Registration:
    """The record and block pipeline of a running aggregated engine (``register``)."""

    def __init__(self, cfg: AggregatedConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.record = LeasedRecord(cfg.access, cfg.record(tokenizer, ready=False),
                                   name=AGGREGATED)
        self.sink: Callable[[list[KVEvent]], None] | None = None

    def serving(self) -> None:
        """The engine serves: the record says ``ready``."""
        self.record.publish(self.cfg.record(self.tokenizer, ready=True))


async def register(stack: contextlib.AsyncExitStack, cfg: AggregatedConfig, tokenizer: Any
                   ) -> Registration:
    """Claim the id (InstanceIdInUse when a live process holds it), publish the record (not
    ready yet) under the lease, and open the block pipeline fed by the returned ``sink``; each
    is closed with ``stack`` (the pipeline first, then the lease is revoked), and a start that
    fails closes what it opened."""
    reg = Registration(cfg, tokenizer)
    await reg.record.claim()
    stack.push_async_callback(reg.record.close)
    await reg.record.start()
    e = cfg.engine
    reg.sink = await index_blocks(stack, reg.record, cfg.access, e.model_name, e.page_size)
    logger.info("aggregated instance %s registered in etcd (blocks of %s indexed)",
                cfg.instance_id, e.model_name)
    return reg
