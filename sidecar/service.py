"""The sidecar's lifecycle: wait for the engine, attach it under a lease, watch it, detach it.

::

    wait ──engine answers /health──▶ attach ──stop──▶ close (lease revoked: keys vanish now)
     ▲                                  │
     └──── unhealthy for the grace ─────┘  (lease revoked: record, ranks, blocks vanish)

One *attachment* is one lease: the instance record, the prefill's rank keys, the blocks of its
KV events and the ingestion counters all live under it, so a dead sidecar takes them with it
(TTL), and a revoked lease removes them at once. While attached, ``/health`` is asked every
``health_interval``: ``unhealthy_after`` failures in a row write ``healthy: false`` into the
record (routers stop choosing it); answers again clear it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq

from bootstrap.client import BootstrapClient, BootstrapClientConfig
from bootstrap.errors import BadResponse
from index.agent import counters_doc
from index.agent_stats import StatsPublisher
from index.claim import connect_and_claim, ensure_id_free
from index.etcd import EtcdClient
from index.events.subscriber import KVEventSubscriber
from index.lease import Backoff, cancel_and_wait
from index.lifecycle import undo_on_failure
from index.pipeline import BlockPipeline, open_block_pipeline
from index.presence import InstancePresence
from index.writer import BlockWriter
from sidecar.config import SidecarConfig, http_base
from sidecar.errors import SidecarError
from sidecar.probe import EngineProbe
from sidecar.ranks import RankPoller
from sidecar.record import SOURCE, build_record, page_size_of
from tokenization import TokenizationError, load_tokenizer, tokenizer_record

logger = logging.getLogger(__name__)

WAITING, ATTACHED, UNHEALTHY, STOPPED = "waiting", "attached", "unhealthy", "stopped"


class Attachment:
    """One engine process under one lease: record, ranks, blocks, counters and health."""

    def __init__(self, sidecar: Sidecar, info: dict[str, Any]) -> None:
        cfg = sidecar.config
        self.sidecar = sidecar
        self.config = cfg
        self.info = info
        self.started_at = time.time()
        layout = cfg.layout
        self.record_key = layout.instance(cfg.instance_id)
        # The rank range is swept of keys a previous run left; the record key is always wanted.
        # The client is the sidecar's: the id was claimed once, and it outlives attachments.
        self.presence = InstancePresence(sidecar.client, cfg.lease_ttl,
                                         owned_prefixes=[layout.ranks_prefix(cfg.instance_id)],
                                         owns_client=False, name="sidecar")
        self.session = self.presence.session
        self.keys = self.presence.keys
        self.pipeline: BlockPipeline | None = None
        self.writer: BlockWriter | None = None
        self.subscribed: list[Any] = []
        self.stats: StatsPublisher | None = None
        self.ranks: RankPoller | None = None
        if cfg.bootstrap_url is not None:
            _, host, port = http_base(cfg.bootstrap_url, "--bootstrap-url")
            self.ranks = RankPoller(sidecar.bootstrap, host, port, self.keys, layout,
                                    cfg.instance_id)
        self.healthy = True
        self.failures = 0
        self.unhealthy_since: float | None = None
        self.last_health_error: str | None = None
        self._stack = contextlib.AsyncExitStack()
        self._tasks: list[asyncio.Task[None]] = []
        self._warned_page: int | None = None
        self._warned_model: str | None = None

    # --- the record -------------------------------------------------------------------------

    def publish(self) -> None:
        cfg, ranks = self.config, self.ranks
        served = self.info.get("served_model")
        if served is not None and served != cfg.model and served != self._warned_model:
            self._warned_model = served
            logger.warning("instance %s: the engine serves %r, not --model %r: requests naming "
                           "%r are refused by it; give the sidecar --model %s (or the engine "
                           "--served-model-name %s)", cfg.instance_id, served, cfg.model,
                           cfg.model, served, cfg.model)
        topo = ranks.topology if ranks else None
        page = page_size_of(self.info, topo)
        if page is not None and page != cfg.block_size and page != self._warned_page:
            self._warned_page = page
            logger.warning("instance %s: the engine's page size %d differs from --block-size %d: "
                           "every KV event will be refused (block_size_mismatch) and routers "
                           "see no prefix here; start the engine with --page-size %d or the "
                           "sidecar with --block-size %d", cfg.instance_id, page,
                           cfg.block_size, cfg.block_size, page)
        rec = build_record(cfg, info=self.info, topo=topo,
                           registered=len(ranks.ranks) if ranks else 0,
                           ready=ranks.ready if ranks else True, healthy=self.healthy,
                           started_at=self.started_at, tokenizer=self.sidecar.tokenizer)
        self.keys.set(self.record_key, rec.to_json())

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe to the KV events (binding their sockets), take a lease, write everything;
        a step that fails undoes the ones before it."""
        cfg, stack = self.config, self._stack
        async with undo_on_failure() as undo:
            undo.push_async_callback(stack.aclose)
            # Revoked last, after every writer under it stopped (the stack closes in reverse).
            stack.push_async_callback(self.presence.close)
            stack.push_async_callback(self._stop_tasks)
            if self.ranks is not None:
                await self.ranks.poll()  # BadResponse: not SGLang's topology document
            self.publish()
            if cfg.events is not None:
                try:
                    pipeline = await open_block_pipeline(
                        stack, self.session, cfg.index_etcd, cfg.layout, cfg.model,
                        cfg.instance_id, block_size=cfg.block_size, sources=cfg.event_sources())
                except zmq.ZMQError as exc:
                    raise SidecarError(cfg.instance_id, f"cannot bind KV-event endpoint "
                                       f"{cfg.events.endpoint} (or a DP rank's port + r): {exc}; "
                                       "check --kv-events and --dp-size") from None
                self.pipeline, self.writer = pipeline, pipeline.writer
                self.subscribed = pipeline.subscribed
                ingestors, subs = pipeline.ingestors, pipeline.subscribers
                await self._await_publishers(subs)
                self.stats = StatsPublisher.with_session(
                    self.session, cfg.layout, cfg.instance_id,
                    lambda: counters_doc(cfg.model, ingestors, pipeline.writer, subs))
            self.presence.start()
            if self.stats is not None:
                self._spawn(self.stats.run(), "sidecar-stats")
            if self.ranks is not None:
                self._spawn(self._poll_ranks(), "sidecar-ranks")

    async def _await_publishers(self, subs: list[KVEventSubscriber]) -> None:
        """Hold the record back until every DP rank's publisher is connected (or the wait is
        over): a router would otherwise send it requests whose events nobody receives."""
        wait = self.config.publisher_wait
        if not wait or not subs:
            return
        t0 = time.monotonic()
        ok = await asyncio.gather(*(s.wait_publisher(wait) for s in subs))
        missing = [s.config.endpoint for s, up in zip(subs, ok, strict=True) if not up]
        if missing:
            logger.warning("sidecar %s: no KV-event publisher connected to %s within %g s; going "
                        "on (the engine's --kv-events-config endpoint must be this one; what it "
                        "publishes before connecting is lost)", self.config.instance_id,
                        ", ".join(missing), wait)
        else:
            logger.info("sidecar %s: KV-event publisher%s connected after %.2f s",
                     self.config.instance_id, "s" if len(subs) > 1 else "",
                     time.monotonic() - t0)

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _stop_tasks(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def close(self) -> None:
        """Stop everything; the lease is revoked, so record, ranks and blocks vanish now."""
        await self._stack.aclose()

    async def wait_synced(self, timeout: float | None = None) -> bool:
        return await self.keys.wait_synced(timeout)

    async def _poll_ranks(self) -> None:
        assert self.ranks is not None
        while True:
            await asyncio.sleep(self.config.bootstrap_poll)
            try:
                changed = await self.ranks.poll()
            except BadResponse as exc:
                # It answered SGLang's document before: log and keep the last good table.
                logger.error("instance %s: %s", self.config.instance_id, exc)
                continue
            except Exception:  # noqa: BLE001 - the table must keep being read
                logger.exception("instance %s: reading the bootstrap table failed",
                                 self.config.instance_id)
                continue
            if changed:
                self.publish()

    async def watch(self, stop: asyncio.Event) -> bool:
        """Check ``/health`` until ``stop`` (True) or the engine stayed unhealthy for the
        grace (False: the caller detaches)."""
        cfg, probe = self.config, self.sidecar.probe
        while not stop.is_set():
            tasks = self.presence.tasks + self._tasks + (
                self.pipeline.tasks if self.pipeline is not None else [])
            dead = next((t for t in tasks if t.done() and not t.cancelled()), None)
            if dead is not None:
                # A lease, key, writer or poller task that ended would freeze what etcd shows:
                # start over under a new lease instead.
                logger.error("instance %s: task %s ended (%r): re-attaching", cfg.instance_id,
                             dead.get_name(), dead.exception())
                return False
            error = await probe.health()
            now = time.monotonic()
            if error is None:
                if not self.healthy:
                    logger.warning("instance %s: engine %s answers again; healthy",
                                   cfg.instance_id, cfg.engine_url)
                    self.healthy, self.unhealthy_since = True, None
                    # Maybe a restarted process: what it serves may have changed.
                    self.info = await probe.server_info() or self.info
                    self.publish()
                self.failures = 0
            else:
                self.failures += 1
                self.last_health_error = error
                if self.healthy and self.failures >= cfg.unhealthy_after:
                    self.healthy, self.unhealthy_since = False, now
                    logger.warning("instance %s: engine %s unhealthy (%s, %d checks in a row): "
                                   "marked in its record; lease revoked in %g s unless it "
                                   "recovers", cfg.instance_id, cfg.engine_url, error,
                                   self.failures, cfg.unhealthy_grace)
                    self.publish()
            if (not self.healthy and self.unhealthy_since is not None
                    and now - self.unhealthy_since >= cfg.unhealthy_grace):
                logger.warning("instance %s: engine unhealthy for %g s: revoking its lease "
                               "(record, ranks and blocks leave every router)", cfg.instance_id,
                               cfg.unhealthy_grace)
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.health_interval)
        return True


class Sidecar:
    """``await start()`` (claims the id, loads the tokenizer), ``await run(stop)``, ``close()``."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.client = EtcdClient(config.etcd)
        self.probe = EngineProbe(config.engine_url, config.health_timeout,
                                 engine=config.engine, model=config.model)
        self.bootstrap = BootstrapClient(BootstrapClientConfig(
            tries=1, retry_interval_s=0.0, timeout_s=max(1.0, config.health_timeout)))
        self.tokenizer: dict[str, Any] | None = None
        self.state = WAITING
        self.attachment: Attachment | None = None
        self.attachments = 0

    async def start(self) -> None:
        cfg = self.config
        async with undo_on_failure() as undo:
            if cfg.tokenizer is not None:
                try:
                    tok = await asyncio.to_thread(load_tokenizer, cfg.tokenizer)
                except TokenizationError as exc:
                    raise SidecarError(cfg.instance_id, f"--tokenizer: {exc}") from None
                self.tokenizer = tokenizer_record(tok)
            undo.push_async_callback(self.client.close)
            await connect_and_claim(self.client, cfg.layout.instance(cfg.instance_id),
                                    cfg.instance_id, source=SOURCE)
            undo.push_async_callback(self.probe.close)
            await self.probe.start()
            undo.push_async_callback(self.bootstrap.close)
            await self.bootstrap.start()

    async def close(self) -> None:
        if self.attachment is not None:
            await self.attachment.close()
            self.attachment = None
        await self.bootstrap.close()
        await self.probe.close()
        await self.client.close()
        self.state = STOPPED

    async def run(self, stop: asyncio.Event) -> None:
        """Attach whenever the engine answers, until ``stop``; SidecarError when the engine's
        bootstrap server answers something that is not SGLang's topology document."""
        cfg = self.config
        while not stop.is_set():
            info = await self._wait_engine(stop)
            if info is None:
                return
            if self.attachments:
                # After a revoke nobody holds the id: check again that no other sidecar took it
                # (also the first check when etcd was away at start).
                await ensure_id_free(self.client, cfg.layout.instance(cfg.instance_id),
                                     cfg.instance_id, source=SOURCE)
            att = Attachment(self, info)
            try:
                await att.start()
            except BadResponse as exc:
                raise SidecarError(cfg.instance_id, f"--bootstrap-url {cfg.bootstrap_url}: "
                                   f"{exc.reason}") from None
            self.attachment, self.state = att, ATTACHED
            self.attachments += 1
            logger.info("instance %s (%s, %s) attached: engine %s%s%s", cfg.instance_id,
                        cfg.role, cfg.model, cfg.engine_url,
                        f", bootstrap {cfg.bootstrap_url}" if cfg.bootstrap_url else "",
                        f", KV events {cfg.events.endpoint} x{cfg.dp_size}" if cfg.events else "")
            try:
                stopped = await att.watch(stop)
            finally:
                self.attachment = None
                await att.close()
            if stopped:
                return
            self.state = WAITING

    async def _wait_engine(self, stop: asyncio.Event) -> dict[str, Any] | None:
        """Wait (with backoff) until ``/health`` answers 200; its server info, or None on stop."""
        backoff = Backoff(first=0.2, cap=5.0)
        tries = 0
        while not stop.is_set():
            error = await self.probe.health()
            if error is None:
                if tries:
                    logger.info("engine %s answers after %d tries", self.config.engine_url, tries)
                return await self.probe.server_info()
            tries += 1
            delay = backoff.next()
            log = logger.warning if tries == 1 or tries % 10 == 0 else logger.info
            log("instance %s: waiting for engine %s to answer GET /health (%s; try %d, next in "
                "%.1f s)", self.config.instance_id, self.config.engine_url, error, tries, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return None
