"""Worker discovery from etcd instance keys: get, then watch from the next revision.

Instances register ``/{prefix}/v1/instances/{id}`` under their lease; when one dies the lease
expires and the delete arrives here as a watch event, so pools follow etcd within a watch round
trip. The get-then-watch loop is ``index.follow.PrefixFollower``: a broken watch resumes from the
last applied revision + 1 (a delete missed while disconnected still arrives), and a compaction,
a silent stream or a failure to apply answers with a fresh snapshot that the etcd-sourced
workers are reconciled with. A key that is no instance key (not UTF-8, an invalid id) is skipped,
and a record that ``index.record`` refuses (malformed, or written by a newer kvatlas) is skipped
like one without a url (its instance leaves the pools); both are counted by reason in
``stats()["skipped"]`` (records also in ``records_refused``) and logged once per key
(``index.follow``), and every other key applies, deletions included.

A watch on a member that lost its leader neither fails nor delivers events (etcd 3.5 even
answers progress requests from its local store), so a linearizable probe checks quorum and
progress requests keep a healthy stream talking (``WatchLiveness``): when either goes quiet for
``stale_after`` seconds the state reads "degraded" (pools stay as last known), and a silent
stream is answered with a snapshot. etcd's "created" response does not count as hearing from
the stream: a watch that opens and delivers nothing reads "degraded".
"""
from __future__ import annotations

import logging
import time

from index.etcd import EtcdClient
from index.follow import Entry, PrefixFollower
from index.keys import KeyLayout
from index.record import REASONS, InstanceRecord
from router.workers import ETCD, ROLES, WorkerPools, routable_record

logger = logging.getLogger(__name__)

ETCD_SOURCE = ETCD


class InstanceDiscovery(PrefixFollower):
    """Keeps the etcd-sourced workers of ``pools`` equal to the instance keys in etcd."""

    kind = "instances"

    def __init__(self, client: EtcdClient, layout: KeyLayout, pools: WorkerPools,
                 model: str | None = None, progress_every: float = 1.0,
                 stale_after: float = 3.0) -> None:
        super().__init__(client, layout.instances_prefix(), "instance discovery", stale_after,
                         progress_every)
        self.layout = layout
        self.pools = pools
        self.model = model
        self.synced_at: float | None = None

    @property
    def state(self) -> str:
        """"connecting", "synced" (watching) or "degraded" (etcd away or without quorum, or a
        watch that does not deliver; pools as last known)."""
        if not self.ready:
            # Before the first snapshot: trouble already seen reads as such (the router's
            # /readiness reports the index "stale" then rather than merely starting).
            return "degraded" if self.last_error is not None else "connecting"
        return "synced" if self.connected else "degraded"

    async def wait_synced(self, timeout: float | None = None) -> bool:
        """Wait for the first full snapshot; False on timeout."""
        return await self.wait_ready(timeout)

    def stats(self) -> dict[str, object]:
        return {"state": self.state, **self.follow_stats(),
                "probe_error": self.liveness.last_probe_error,
                "records_refused": {r: self.skipped[r] for r in REASONS}}

    # --- the follower's hooks ---------------------------------------------------------------

    def parse_key(self, key: bytes) -> str:
        return self.layout.parse_instance(key)

    def decode(self, name: str, value: bytes) -> InstanceRecord:
        return InstanceRecord.from_json(value, key=self.layout.instance(name), instance_id=name)

    def load(self, revision: int, entries: list[Entry]) -> None:
        seen: set[tuple[str, str]] = set()
        for e in entries:
            key = self._apply_put(e.name, e.data)
            if key is not None:
                seen.add(key)
        # Reconcile: an etcd-sourced worker whose key is gone left while we were not watching.
        for role in ROLES:
            for worker in self.pools.pool(role):
                if worker.source == ETCD_SOURCE and (role, worker.instance_id) not in seen:
                    self.pools.remove(role, worker.instance_id)
        self.synced_at = time.time()

    def apply(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.data is not None:
                self._apply_put(e.name, e.data)
            else:  # deleted, or now a record nobody can read: either way not a worker
                self._apply_delete(e.name)

    def _apply_put(self, iid: str, record: InstanceRecord) -> tuple[str, str] | None:
        # ``record`` passed ``decode`` already: read once, by the follow loop.
        rec = routable_record(iid, record)
        if rec is None or (self.model is not None and rec["model"] not in (None, self.model)):
            self._apply_delete(iid)
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

    def _apply_delete(self, iid: str) -> None:
        for role in ROLES:
            worker = self.pools.get(role, iid)
            if worker is not None and worker.source == ETCD_SOURCE:
                self.pools.remove(role, iid)
