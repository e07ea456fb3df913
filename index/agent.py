"""The index agent: indexes any engine that publishes KV events (vLLM, SGLang, ours) in etcd.

One agent serves one engine instance::

    engine --ZMQ PUB--> KVEventSubscriber --> InstanceIngestor --> BlockWriter --> etcd
                        (+ DEALER replay)     (own hashes from     (coalesced txns under
                                               token_ids)           the instance lease)

Everything it writes lives under one lease, so when the agent (or its host) dies the instance's
blocks vanish from every router's mirror. Besides the blocks it keeps the instance visible:

- if no instance record exists for the id (an engine without a kvatlas bootstrap server, e.g. a
  stock vLLM), it writes one (``"source": "kv-events"``) under its lease. A record written by
  someone else (the instance's bootstrap server) is left alone, and when one appears later the
  agent stops maintaining its own without deleting theirs;
- it publishes its ingestion counters to ``/{prefix}/v1/stats/{id}`` (``index.agent_stats``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from index.access import DEFAULT_LEASE_TTL, ClusterAccess
from index.agent_stats import StatsPublisher
from index.errors import EtcdError, IndexLayerError
from index.etcd import EtcdClient, EtcdSettings
from index.events.ingest import InstanceIngestor
from index.events.subscriber import KVEventSubscriber, SubscriberConfig
from index.hashing import DEFAULT_BLOCK_SIZE
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_instance_id, validate_model
from index.lease import LeaseSession, cancel_and_wait
from index.lifecycle import undo_on_failure
from index.owned import LeasedKeys
from index.pipeline import BlockPipeline
from index.presence import Claim, InstancePresence
from index.record import ENGINE_UNKNOWN, ROLES, InstanceRecord
from index.shards import IndexShards
from index.writer import BlockWriter, BlockWriterConfig

logger = logging.getLogger(__name__)

SOURCE = "kv-events"


class AgentError(IndexLayerError):
    """The agent cannot start; the message says which setting to change."""

    def __init__(self, instance_id: str, reason: str) -> None:
        self.instance_id = instance_id
        self.reason = reason
        super().__init__(f"index agent {instance_id}: {reason}")


@dataclass
class AgentConfig:
    """Settings of one index agent (one engine instance, one model)."""

    instance_id: str
    """The engine instance whose blocks are indexed (the id routers see)."""
    model: str
    """Model served by the instance: part of every block key, and topics ``kv@pod@other`` naming
    another model are refused."""
    events: SubscriberConfig = field(default_factory=SubscriberConfig)
    """Where the engine's KV events come from (endpoint, replay, topic)."""
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    """The etcd cluster holding the index."""
    etcd_prefix: str = DEFAULT_PREFIX
    """Key prefix of every key written."""
    role: str = "prefill"
    """Role written into the instance record when the agent has to create one."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Index block size in tokens; events of another size are refused (counted by reason)."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """Seconds the instance's keys survive the agent's death."""
    stats_interval: float = 1.0
    """Seconds between publications of the counters (only when something changed)."""
    record_check_interval: float = 5.0
    """Seconds between checks that the instance record exists (and who owns it)."""
    writer: BlockWriterConfig = field(default_factory=BlockWriterConfig)
    """How block changes are coalesced into etcd transactions."""
    index_etcd: IndexShards = field(default_factory=IndexShards)
    """The etcd clusters the block index is spread over (``--index-etcd``); none: ``etcd``."""
    access: ClusterAccess = field(init=False, repr=False, compare=False)
    """``etcd``, ``etcd_prefix``, ``index_etcd`` and ``lease_ttl`` as one checked
    ``ClusterAccess``."""

    def __post_init__(self) -> None:
        validate_instance_id(self.instance_id)
        validate_model(self.model)
        if self.events.model is None:
            # A copy: the caller's SubscriberConfig is not changed behind its back.
            self.events = replace(self.events, model=self.model)
        self.access = ClusterAccess(etcd=self.etcd, prefix=self.etcd_prefix,
                                    index_shards=self.index_etcd, lease_ttl=self.lease_ttl)
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is invalid: use one of {list(ROLES)}")
        if not 1 <= self.block_size <= 65536:
            raise ValueError(f"block size must be within [1, 65536] tokens, got {self.block_size}")
        if not 0.05 <= self.stats_interval <= 3600:
            raise ValueError(f"stats interval must be within [0.05, 3600] s, got {self.stats_interval}")
        if not 0.1 <= self.record_check_interval <= 3600:
            raise ValueError("record check interval must be within [0.1, 3600] s, got "
                             f"{self.record_check_interval}")

    @property
    def layout(self) -> KeyLayout:
        return self.access.layout

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Agent flags, the KV-event flags included (etcd flags are the CLI's own)."""
        parser.add_argument("--instance-id", required=True, help="engine instance id")
        parser.add_argument("--model", required=True, help="model the instance serves")
        parser.add_argument("--role", choices=ROLES, default="prefill",
                            help="role for the instance record the agent writes when none exists "
                                 "(default prefill)")
        parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                            help=f"index block size in tokens (default {DEFAULT_BLOCK_SIZE})")
        parser.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                            help="seconds the instance's keys outlive the agent "
                                 f"(default {DEFAULT_LEASE_TTL})")
        parser.add_argument("--stats-interval", type=float, default=1.0,
                            help="seconds between counter publications (default 1)")
        SubscriberConfig.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      access: ClusterAccess | None = None) -> AgentConfig:
        """Build from parsed flags; ``access`` is what the CLI built from its etcd flags
        (None: the default etcd and prefix)."""
        access = access or ClusterAccess()
        return cls(instance_id=args.instance_id, model=args.model,
                   events=SubscriberConfig.from_cli_args(args), etcd=access.main_etcd,
                   etcd_prefix=access.prefix, role=args.role,
                   block_size=args.block_size, lease_ttl=args.lease_ttl,
                   stats_interval=args.stats_interval, index_etcd=access.index_shards)


class RecordKeeper:
    """Writes the instance record under the agent's lease only while nobody else provides one.

    etcd offers no "put if absent" through our client, so this checks every ``interval``: when
    the key is missing it is (re)claimed; when it is found under a lease that is not ours, the
    other writer (normally the instance's bootstrap server) owns it and ours is dropped without a
    delete. The window between a check and a claim is small; a bootstrap server rewrites its
    record on every rank change and on every new lease, so it wins any such race for good.
    """

    def __init__(self, session: LeaseSession, key: bytes, value: InstanceRecord,
                 interval: float) -> None:
        self.session = session
        self.client: EtcdClient = session.client
        self.key = key
        self.value = value
        self.interval = interval
        self.owner: str | None = None
        """``"agent"`` (ours), ``"other"`` (someone else's record) or None (not checked yet)."""
        self.claims = 0
        self._keys: LeasedKeys | None = None
        self._keys_task: asyncio.Task[None] | None = None

    async def check(self) -> None:
        """One round: claim the record if it is missing, give it up if another owner wrote one."""
        lease = await self.session.wait_lease()
        kv = await self.client.get(self.key)
        mine = self._keys
        if kv is None:
            if mine is not None and mine.state == "synced" and mine.synced_lease == lease:
                # Ours, synced, yet gone: deleted behind our back (etcdctl del). LeasedKeys only
                # rewrites on a change or a new lease, so start over with a fresh claim.
                await self._drop()
            if self._keys is None:
                self._claim()
            return  # otherwise ours is being rewritten already (new lease, etcd outage)
        if mine is None:
            self.owner = "other"
            return
        # Ours only if it carries the lease our LeasedKeys last synced with: right after a new
        # lease, the key can still carry the old one until the resync lands.
        if kv.lease != mine.synced_lease and mine.synced_lease == lease and mine.state == "synced":
            logger.info("instance record %s now written by another owner (lease %x); leaving it "
                        "to them", self.key.decode(), kv.lease)
            await self._drop()
            self.owner = "other"

    def _claim(self) -> None:
        logger.info("no instance record at %s: writing one under the agent's lease",
                    self.key.decode())
        keys = LeasedKeys(self.session, [])
        keys.set(self.key, self.value.to_json())
        self._keys = keys
        self._keys_task = asyncio.create_task(keys.run(), name="instance-record")
        self.owner = "agent"
        self.claims += 1

    async def _drop(self) -> None:
        task, self._keys_task, self._keys = self._keys_task, None, None
        await cancel_and_wait(task)

    async def wait_synced(self, timeout: float | None = None) -> bool:
        return True if self._keys is None else await self._keys.wait_synced(timeout)

    async def run(self) -> None:
        """Check every ``interval`` until cancelled; etcd trouble only delays the next check."""
        try:
            while True:
                try:
                    await self.check()
                except EtcdError as exc:
                    logger.debug("instance record check failed, retrying: %s", exc)
                await asyncio.sleep(self.interval)
        finally:
            await self._drop()


def agent_record(config: AgentConfig, started_at: float) -> InstanceRecord:
    """The record the agent writes when nobody else provides one (``source: "kv-events"``)."""
    return InstanceRecord(
        instance_id=config.instance_id, role=config.role, model=config.model, source=SOURCE,
        kv_events=config.events.endpoint, block_size=config.block_size, started_at=started_at,
        engine=ENGINE_UNKNOWN)


class IndexAgent:
    """Subscriber -> ingestor -> block writer for one instance, all under one lease.

    ``await start()``, then ``await close()`` (which revokes the lease: the instance's keys vanish
    at once; ``close(revoke=False)`` lets them expire with the TTL instead, as a crash would).
    """

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        layout = config.layout
        iid = config.instance_id
        self.presence = InstancePresence(
            EtcdClient(config.etcd), config.lease_ttl,
            claim=Claim(layout.instance(iid), iid, source=SOURCE), name="agent")
        self.client = self.presence.client
        self.session = self.presence.session
        self.pipeline = BlockPipeline(self.session, config.index_etcd, layout, config.model, iid,
                                      block_size=config.block_size, sources=[(0, config.events)],
                                      writer_config=config.writer)
        self.blocks = self.pipeline.blocks
        self.writer = self.pipeline.writer
        self.ingestor, self.subscriber = self.pipeline.subscribed[0]
        self.started_at = time.time()
        self.record = RecordKeeper(self.session, layout.instance(iid),
                                   agent_record(config, self.started_at),
                                   config.record_check_interval)
        self.publisher = StatsPublisher.with_session(self.session, layout, iid, self.counters,
                                                     config.stats_interval)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Start every part; when a step fails (InstanceIdInUse, a bad endpoint, anything) the
        steps before it are undone in reverse order (``index.lifecycle``) and the error goes on."""
        cfg = self.config
        async with undo_on_failure() as undo:
            # etcd away: events are indexed in memory and written by the writer's resync once
            # the lease loop reaches it.
            await self.presence.claim()
            # Closed (revoked) after everything below stopped, so nothing renews or rewrites it.
            undo.push_async_callback(self.presence.close)
            self.presence.start()
            undo.push_async_callback(self.pipeline.close)
            try:
                await self.pipeline.start()
            except zmq.ZMQError as exc:
                verb = "bind" if cfg.events.binds else "connect to"
                raise AgentError(cfg.instance_id, f"cannot {verb} KV-event endpoint "
                                 f"{cfg.events.endpoint}: {exc}; check --kv-events") from None
            undo.push_async_callback(self._stop_tasks)
            self._tasks.append(asyncio.create_task(self.record.run(), name="agent-record"))
            self._tasks.append(asyncio.create_task(self.publisher.run(), name="agent-stats"))
        logger.info("index agent %s (%s) started: KV events %s %s, etcd %s, blocks on index "
                    "shard %d (%s)", cfg.instance_id, cfg.model,
                    "bound at" if cfg.events.binds else "from", cfg.events.endpoint,
                    cfg.etcd.display, self.blocks.shard, self.blocks.endpoint)

    async def _stop_tasks(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def close(self, revoke: bool = True) -> None:
        """Stop; with ``revoke`` every key of the instance is deleted now (clean shutdown)."""
        await self.pipeline.close(revoke)
        await self._stop_tasks()
        await self.presence.close(revoke)

    async def __aenter__(self) -> IndexAgent:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait until etcd holds the current block set (and our instance record, if any)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if not await self.writer.wait_synced(timeout):
            return False
        left = None if deadline is None else max(0.0, deadline - loop.time())
        return await self.record.wait_synced(left)

    # --- counters ---------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """What is published to the stats key (no timestamp: compared to skip idle rewrites)."""
        return counters_doc(self.config.model, self.ingestor, self.writer, self.subscriber)

    def stats(self) -> dict[str, Any]:
        """Everything: subscriber, ingestor, writer, lease, record and publisher counters."""
        return {
            "subscriber": self.subscriber.stats(), "writer": self.writer.stats(),
            "lease": {"id": self.session.lease_id, "healthy": self.session.healthy,
                      "generation": self.session.generation, "last_error": self.session.last_error,
                      "late_keepalives": self.session.late_keepalives},
            "block_lease": {"shard": self.blocks.shard, "endpoint": self.blocks.endpoint,
                            "id": self.blocks.session.lease_id,
                            "healthy": self.blocks.session.healthy},
            "record_owner": self.record.owner, "stats_publishes": self.publisher.publishes,
        }


def counters_doc(model: str, ingestor: InstanceIngestor | Sequence[InstanceIngestor],
                 writer: BlockWriter,
                 subscriber: KVEventSubscriber | Sequence[KVEventSubscriber] | None = None
                 ) -> dict[str, Any]:
    """The stats-key document of one ingesting instance (``kvatlas index stats`` reads it).

    For any process that ingests KV events into a ``BlockWriter`` (this agent, a sidecar, or an
    engine indexing its own cache, all through ``index.pipeline``): pass it as the source of a
    ``StatsPublisher``, e.g. ``lambda: counters_doc(model, ingestor, writer)``. Several
    ingestors (one per attention-DP rank, each its own event stream) are summed; ``state`` is
    the first one not ``synced``, and ``last_seq`` is per rank when there are several.
    """
    ingestors = [ingestor] if isinstance(ingestor, InstanceIngestor) else list(ingestor)
    stats = [i.stats for i in ingestors]
    rejected: Counter[str] = Counter()
    for st in stats:
        rejected.update(st.rejected)
    states = [i.state for i in ingestors]
    doc: dict[str, Any] = {
        "instance_id": ingestors[0].instance, "model": model, "source": SOURCE,
        "state": next((s for s in states if s != "synced"), states[0]),
        "last_seq": stats[0].last_seq if len(stats) == 1 else [st.last_seq for st in stats],
        "batches": sum(st.batches for st in stats), "applied": sum(st.applied for st in stats),
        "rejected": dict(rejected), "gaps": sum(st.gaps for st in stats),
        "dropped": sum(st.dropped for st in stats),
        "replays": sum(st.replays for st in stats), "clears": sum(st.clears for st in stats),
        "restarts": sum(st.restarts for st in stats),
        "blocks": len(writer), "writer_state": writer.state, "pending": writer.pending,
        "write_lag_s": round(writer.lag, 3),
    }
    if subscriber is not None:
        subs = [subscriber] if isinstance(subscriber, KVEventSubscriber) else list(subscriber)
        malformed: Counter[str] = Counter()
        for sub in subs:
            malformed.update(sub.malformed)
        doc["malformed"] = dict(malformed)
        doc["received"] = sum(sub.received for sub in subs)
        doc["publishers"] = sum(sub.publishers for sub in subs)
    return doc
