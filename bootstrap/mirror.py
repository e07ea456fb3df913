"""Mirror of one instance's rank table into etcd, under the instance lease.

The in-memory table stays the authority. This module only keeps etcd equal to it: one instance
key plus one key per registered cell, all under one lease. ``index.owned.LeasedKeys`` does the
retrying, the rewrite after a new lease and the removal of stale keys of this instance.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from bootstrap.config import BootstrapConfig
from bootstrap.errors import BootstrapLayerError
from bootstrap.table import Cell, RankEntry, RankTable
from index.errors import MalformedValue
from index.etcd import EtcdClient
from index.framing import finite_number, strict_int
from index.keys import KeyLayout, dumps, loads
from index.presence import Claim, InstancePresence
from index.record import PREFILL, InstanceRecord

logger = logging.getLogger(__name__)

ROLE = PREFILL


def rank_value(cell: Cell, entry: RankEntry) -> dict[str, Any]:
    dp, cp, tp, pp = cell
    return {"rank_ip": entry.rank_ip, "rank_port": entry.rank_port, "dp": dp, "cp": cp, "tp": tp,
            "pp": pp, "attn_dp_rank": entry.attn_dp_rank, "system_dp_rank": entry.system_dp_rank,
            "registered_at": entry.registered_at}


class MalformedRank(BootstrapLayerError, MalformedValue):
    """A rank key's value that is not what ``rank_value`` writes; ``reason`` ``bad_rank``."""

    def __init__(self, detail: str, key: bytes | str = "") -> None:
        MalformedValue.__init__(self, "bad_rank", detail, key)


def parse_rank_value(raw: bytes, cell: Cell, key: bytes | str = "") -> RankEntry:
    """The entry of a rank key's value (``rank_value``'s inverse) for ``cell`` (the key's);
    MalformedRank for anything else, and nothing else: the value comes from etcd."""
    try:
        doc = loads(raw)
    except (ValueError, TypeError, RecursionError) as exc:  # UnicodeDecodeError included
        raise MalformedRank(f"not JSON ({type(exc).__name__})", key) from None
    if not isinstance(doc, dict):
        raise MalformedRank(f"not a JSON object but {type(doc).__name__}", key)
    ip, port, at = doc.get("rank_ip"), doc.get("rank_port"), doc.get("registered_at")
    attn, system = doc.get("attn_dp_rank"), doc.get("system_dp_rank")
    # strict_int: a bool is an int to Python, and no port or rank.
    if not isinstance(ip, str) or not ip or not strict_int(port, 1, 65535):
        raise MalformedRank(f"rank_ip {str(ip)[:40]!r} / rank_port {str(port)[:20]!r}", key)
    if not finite_number(at):
        raise MalformedRank(f"registered_at {str(at)[:20]!r} is not a finite number", key)
    for name, rank in (("attn_dp_rank", attn), ("system_dp_rank", system)):
        if rank is not None and not strict_int(rank, 0, 2**31):
            raise MalformedRank(f"{name} {str(rank)[:20]!r} is not a rank", key)
    named = tuple(doc.get(n) for n in ("dp", "cp", "tp", "pp"))
    if any(v is not None for v in named) and named != tuple(cell):
        raise MalformedRank(f"cell {named} disagrees with its key's {tuple(cell)}", key)
    return RankEntry(ip, port, float(at), attn, system)


def readable_ranks(layout: KeyLayout, kvs: list[Any]) -> list[dict[str, Any]]:
    """The rank entries of ``kvs`` (one instance's rank keys) that read as ``rank_value``
    writes them, each with its cell under ``key``; a malformed key or value is left out, as
    the decodes that resolve ranks leave it out."""
    out = []
    for kv in kvs:
        try:
            _, cell = layout.parse_rank(kv.key)
            parse_rank_value(kv.value, cell, kv.key)
        except MalformedValue:
            continue
        out.append({**loads(kv.value), "key": cell})
    return out


class RankMirror:
    """Keeps ``/…/instances/{id}`` and ``/…/ranks/{id}/…`` equal to a RankTable."""

    def __init__(self, config: BootstrapConfig, table: RankTable) -> None:
        if config.etcd is None:
            raise ValueError("RankMirror needs etcd settings")
        self.config = config
        self.table = table
        self.layout = config.layout
        self.started_at = time.time()
        iid = config.instance_id
        # Only the rank range is swept for stale keys: the instance key is always desired, and
        # using it as a prefix would also match other instances whose id starts with ours.
        self.presence = InstancePresence(
            EtcdClient(config.etcd), config.lease_ttl,
            owned_prefixes=[self.layout.ranks_prefix(iid)],
            claim=Claim(self.layout.instance(iid), iid,
                        meanwhile="serving from memory and retrying"),
            name="bootstrap")
        self.client = self.presence.client
        self.session = self.presence.session
        self.keys = self.presence.keys
        self.publish_instance()

    # --- desired state ----------------------------------------------------------------------

    def instance_value(self) -> InstanceRecord:
        """This prefill's instance record: ``instance_fields`` (known names as fields, the rest
        kept as extra fields), overridden by what the server itself knows."""
        cfg, table = self.config, self.table
        topo = table.topology
        core: dict[str, Any] = {
            "instance_id": cfg.instance_id,
            "role": ROLE,
            "model": cfg.model,
            "bootstrap_host": cfg.public_host,
            "bootstrap_port": cfg.port,
            "expected_ranks": table.expected,
            "registered_ranks": table.registered,
            "ready": table.ready,
            "started_at": self.started_at,
            "topology": None if topo is None else topo.scalars(),
        }
        if topo is not None:
            # What the ranks registered is the truth about the KV layout decodes will read.
            core.update(pp_size=topo.pp_size, cp_size=topo.attn_cp_size,
                        page_size=topo.page_size, kv_cache_dtype=topo.kv_cache_dtype)
        return InstanceRecord.build(cfg.instance_fields, **core)

    def publish_instance(self) -> None:
        self.keys.set(self.layout.instance(self.config.instance_id),
                      self.instance_value().to_json())

    def publish_cell(self, cell: Cell) -> None:
        """Call after the table stored ``cell``: updates that rank's key and the instance record."""
        entry = self.table.lookup(cell)
        key = self.layout.rank(self.config.instance_id, *cell)
        if entry is None:
            self.keys.delete(key)
        else:
            self.keys.set(key, dumps(rank_value(cell, entry)))
        self.publish_instance()

    # --- state for /metrics and /health -----------------------------------------------------

    @property
    def state(self) -> str:
        """"connecting", "synced" or "degraded" (etcd away; serving from memory, retrying)."""
        if not self.session.healthy and self.session.last_error:
            return "degraded"
        return self.keys.state

    @property
    def lag(self) -> float:
        return self.keys.lag

    async def wait_synced(self, timeout: float | None = None) -> bool:
        return await self.keys.wait_synced(timeout)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and start mirroring; InstanceIdInUse when a live process holds the id."""
        await self.presence.open()

    async def close(self, revoke: bool = True) -> None:
        """Stop mirroring; with ``revoke`` the lease is revoked so every key vanishes now."""
        await self.presence.close(revoke)
