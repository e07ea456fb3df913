"""Worker discovery from etcd instance keys: get, then watch from the next revision.

Instances register ``/{prefix}/v1/instances/{id}`` under their lease; when one dies the lease
expires and the delete arrives here as a watch event, so pools follow etcd within a watch round
trip. After a broken watch the whole prefix is read again and the etcd-sourced workers are
reconciled with it (a delete missed while disconnected is not lost).

A watch on a member that lost its leader neither fails nor delivers events (etcd 3.5 even
answers progress requests from its local store), so a linearizable probe checks quorum and
progress requests keep a healthy stream talking (``WatchLiveness``): when either goes quiet for
``stale_after`` seconds the state reads "degraded" (pools stay as last known), and a silent
stream is reopened.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from index.errors import EtcdError
from index.etcd import EtcdClient, WatchBatch
from index.keys import KeyLayout
from index.lease import Backoff, cancel_and_wait
from index.liveness import WatchLiveness
from router.workers import ROLES, WorkerPools, parse_instance_record

logger = logging.getLogger(__name__)

ETCD_SOURCE = "etcd"


class InstanceDiscovery:
    """Keeps the etcd-sourced workers of ``pools`` equal to the instance keys in etcd."""

    def __init__(self, client: EtcdClient, layout: KeyLayout, pools: WorkerPools,
                 model: str | None = None, progress_every: float = 1.0,
                 stale_after: float = 3.0) -> None:
        if not 0 < progress_every < stale_after:
            raise ValueError(f"need 0 < progress_every < stale_after, got {progress_every} and "
                             f"{stale_after}")
        self.client = client
        self.layout = layout
        self.pools = pools
        self.model = model
        self.prefix = layout.instances_prefix()
        self.revision = 0
        self.progress_every = progress_every
        self.stale_after = stale_after
        self._state = "connecting"
        self.liveness = WatchLiveness(client, self.prefix, stale_after, progress_every)
        self.last_error: str | None = None
        self.synced_at: float | None = None
        self._synced = asyncio.Event()

    @property
    def state(self) -> str:
        """"connecting", "synced" (watching) or "degraded" (etcd away or without quorum; pools
        as last known)."""
        if self._state == "synced" and not self.liveness.connected:
            return "degraded"
        return self._state

    async def wait_synced(self, timeout: float | None = None) -> bool:
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def stats(self) -> dict[str, object]:
        return {"state": self.state, "revision": self.revision, "last_error": self.last_error,
                "probe_error": self.liveness.last_probe_error}

    async def run(self) -> None:
        probe = asyncio.create_task(self.liveness.probe(), name="router-discovery-probe")
        try:
            await self._follow()
        finally:
            await cancel_and_wait(probe)  # see index.lease.cancel_and_wait: never hangs


    async def _follow(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await self._reload()
                watch = self.client.watch_prefix(self.prefix, self.revision + 1,
                                                 self.progress_every)
                async with contextlib.aclosing(watch):
                    it = aiter(watch)
                    while True:
                        try:
                            async with asyncio.timeout(self.stale_after):
                                batch = await anext(it)
                        except StopAsyncIteration:
                            break
                        self._on_batch(batch)
                        backoff.reset()
            except (EtcdError, asyncio.TimeoutError) as exc:
                # TimeoutError: the stream went silent despite progress requests.
                self._state = "degraded"
                self.liveness.broke()
                self.last_error = str(exc) or f"watch silent for {self.stale_after:g} s"
                logger.warning("instance discovery: etcd trouble, keeping pools as they are and "
                               "retrying: %s", exc)
                await asyncio.sleep(backoff.next())

    async def _reload(self) -> None:
        revision, kvs = await self.client.get_prefix(self.prefix)
        seen: set[tuple[str, str]] = set()
        for kv in kvs:
            key = self._apply_put(kv.key, kv.value)
            if key is not None:
                seen.add(key)
        for role in ROLES:
            for worker in self.pools.pool(role):
                if worker.source == ETCD_SOURCE and (role, worker.instance_id) not in seen:
                    self.pools.remove(role, worker.instance_id)
        self.revision = revision
        self._state = "synced"
        self.liveness.heard()
        self.synced_at = time.time()
        self._synced.set()

    def _on_batch(self, batch: WatchBatch) -> None:
        self.liveness.heard()
        for ev in batch.events:
            if ev.put:
                self._apply_put(ev.key, ev.value)
            else:
                self._apply_delete(ev.key)
        self.revision = max(self.revision, batch.revision)

    def _apply_put(self, key: bytes, value: bytes) -> tuple[str, str] | None:
        iid = self.layout.parse_instance(key)
        rec = parse_instance_record(iid, value)
        if rec is None or (self.model is not None and rec["model"] not in (None, self.model)):
            self._apply_delete(key)
            return None
        for role in ROLES:
            # A record whose role changed leaves its old pool.
            if role != rec["role"] and self.pools.get(role, rec["instance_id"]) is not None:
                self.pools.remove(role, rec["instance_id"])
        self.pools.add(rec["role"], rec["url"], instance_id=rec["instance_id"],
                       bootstrap_host=rec["bootstrap_host"], bootstrap_port=rec["bootstrap_port"],
                       model=rec["model"], source=ETCD_SOURCE, ready=rec["ready"],
                       record=rec["raw"])
        return rec["role"], rec["instance_id"]

    def _apply_delete(self, key: bytes) -> None:
        iid = self.layout.parse_instance(key)
        for role in ROLES:
            worker = self.pools.get(role, iid)
            if worker is not None and worker.source == ETCD_SOURCE:
                self.pools.remove(role, iid)
