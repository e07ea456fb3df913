"""An engine instance's etcd record, built one way for every role (prefill, decode, aggregated),
and the record kept under its own lease (``LeasedRecord``) for the roles that write it
themselves (a prefill's is kept by its bootstrap server's mirror)."""
from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.serve_config import EngineServerConfig
from index.access import ClusterAccess
from index.etcd import EtcdClient
from index.events.feed import EventFeed
from index.events.subscriber import SubscriberConfig
from index.events.types import KVEvent
from index.keys import KeyLayout
from index.lease import LeaseSession
from index.pipeline import BlockPipeline, open_block_pipeline
from index.presence import Claim, InstancePresence
from index.record import InstanceRecord
from index.shards import IndexShards
from tokenization import tokenizer_record

logger = logging.getLogger(__name__)

WILDCARDS = ("0.0.0.0", "::", "")
"""Listen addresses no peer can dial."""


def public_host(host: str, advertise_host: str | None) -> str:
    """The host peers dial: ``advertise_host``, else ``host`` unless it is a wildcard (then
    this machine's name)."""
    if advertise_host:
        return advertise_host
    if host in WILDCARDS:
        return socket.getfqdn()
    return host


def check_advertise_host(advertise_host: str | None) -> None:
    """ValueError unless ``advertise_host`` is None or a host peers can dial."""
    if advertise_host is not None and (not advertise_host.strip()
                                       or advertise_host in WILDCARDS):
        raise ValueError(f"--advertise-host must be a host peers can dial, got "
                         f"{advertise_host!r}")


def served_fields(engine: EngineServerConfig, tokenizer: Any) -> dict[str, Any]:
    """What an instance's etcd record says about what it serves, beside ``model`` (the served
    name): ``tokenizer`` (``tokenization.tokenizer_record``: its source and fingerprint, so
    that a router can tell whether it tokenizes as this engine does), ``context_length``, and
    the longest prompt and body it takes, and what it holds at once (``max_running_requests``,
    its KV pool as ``max_total_num_tokens``: router/capacity.py), as ``/server_info`` reports
    them."""
    m = engine.model_config
    return {"tokenizer": tokenizer_record(tokenizer),
            "context_length": m.max_positions,
            "max_prompt_tokens": min(m.max_prompt_tokens, engine.kv_pages * engine.page_size),
            "max_body_bytes": engine.max_request_bytes,
            "max_running_requests": engine.max_running,
            "max_total_num_tokens": engine.kv_pages * engine.page_size}


def engine_record(engine: EngineServerConfig, *, instance_id: str, role: str, host: str,
                  kv_cache_dtype: str, tp_size: int = 1, dp_size: int = 1, ready: bool = True,
                  served: dict[str, Any] | None = None, **more: Any) -> InstanceRecord:
    """The record of an instance of this engine (``host``: the one peers dial; ``served``:
    ``served_fields``; ``more``: role-specific fields). ``started_at`` is now: a new value
    per process."""
    return InstanceRecord(
        instance_id=instance_id, role=role, model=engine.model_name,
        url=f"http://{host}:{engine.port}", tp_size=tp_size, dp_size=dp_size,
        page_size=engine.page_size, kv_cache_dtype=kv_cache_dtype, ready=ready,
        started_at=time.time(), **(served or {}), **more)


class LeasedRecord:
    """An instance record under its own ``InstancePresence``: ``claim()`` first (before
    anything runs that a refusal would have to stop), ``start()`` once the record may be
    published, ``publish()`` to change it, ``close()`` at the end (revoked: it vanishes now)."""

    def __init__(self, access: ClusterAccess, record: InstanceRecord, name: str) -> None:
        assert access.etcd is not None
        self.layout = access.layout
        self.instance_id = record.instance_id
        self.key = self.layout.instance(record.instance_id)
        self.presence = InstancePresence(EtcdClient(access.etcd), access.lease_ttl,
                                         claim=Claim(self.key, record.instance_id), name=name)
        self.client = self.presence.client
        self.publish(record)

    def publish(self, record: InstanceRecord) -> None:
        """Make ``record`` the value kept under the lease."""
        self.record = record
        self.presence.keys.set(self.key, record.to_json())

    async def claim(self) -> None:
        """Connect; InstanceIdInUse when a live process holds the id (etcd away: go on)."""
        await self.presence.claim()

    async def start(self) -> None:
        """Publish the record (after ``claim``) and keep it under the lease."""
        self.presence.start()

    async def close(self) -> None:
        await self.presence.close()


async def index_blocks(stack: contextlib.AsyncExitStack, record: LeasedRecord,
                       access: ClusterAccess, model: str, block_size: int
                       ) -> Callable[[list[KVEvent]], None]:
    """Open the block pipeline of an instance that indexes its own prefix cache (an aggregated
    engine, a decode that prefills locally) under ``record``'s lease (started), so that its
    blocks vanish with it (``open_local_feed``). Returns the sink the engine hands its KV
    events to."""
    _, sink = await open_local_feed(stack, record.presence.session, access.index_shards,
                                    access.layout, model, record.instance_id,
                                    block_size=block_size)
    return sink


async def open_local_feed(stack: contextlib.AsyncExitStack, session: LeaseSession,
                          shards: IndexShards, layout: KeyLayout, model: str, instance_id: str,
                          *, block_size: int, sources: Sequence[tuple[int, SubscriberConfig]] = ()
                          ) -> tuple[BlockPipeline, Callable[[list[KVEvent]], None]]:
    """An instance's block pipeline under ``session``'s lease (``open_block_pipeline``), fed
    in process through an ``EventFeed`` (and by ``sources``' KV events: a prefill's other DP
    groups). Returns it and the sink the engine hands its KV events to; both close with
    ``stack``."""
    pipeline = await open_block_pipeline(stack, session, shards, layout, model, instance_id,
                                         block_size=block_size, sources=sources, local=True)
    assert pipeline.local is not None
    feed = EventFeed(pipeline.local)
    feed.start()
    stack.push_async_callback(feed.close)
    return pipeline, feed.sink
