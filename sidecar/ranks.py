"""A prefill's rank table, read from its own SGLang bootstrap server and mirrored into etcd.

SGLang keeps the table inside the prefill process and exposes it only through ``GET /route``:
the topology document (all four ranks -1, 503 until every rank registered) and one address per
cell. The poller reads both every ``bootstrap_poll`` seconds and sets the same rank keys that
``bootstrap/mirror.py`` writes for kvatlas's own prefills, under the sidecar's lease, so a
decode or ``doctor`` reading etcd cannot tell the two apart.
"""
from __future__ import annotations

import itertools
import logging
import time

from bootstrap.client import BootstrapClient
from bootstrap.errors import BadResponse, BootstrapError, BootstrapNotReady
from bootstrap.mapping import PrefillServerInfo
from bootstrap.mirror import rank_value
from bootstrap.table import Cell, RankEntry
from index.keys import KeyLayout, dumps
from index.owned import LeasedKeys

logger = logging.getLogger(__name__)

WAITING, NOT_READY, READY, UNREACHABLE = "waiting", "not_ready", "ready", "unreachable"


def cells(topo: PrefillServerInfo) -> list[Cell]:
    """Every (dp, cp, tp, pp) the topology says the instance has."""
    return list(itertools.product(range(topo.dp_size), range(topo.attn_cp_size),
                                  range(topo.attn_tp_size), range(topo.pp_size)))


class RankPoller:
    """Keeps the rank keys of one instance equal to what its bootstrap server answers."""

    def __init__(self, client: BootstrapClient, host: str, port: int, keys: LeasedKeys,
                 layout: KeyLayout, instance_id: str) -> None:
        self.client = client
        self.host, self.port = host, port
        self.keys = keys
        self.layout = layout
        self.instance_id = instance_id
        self.state = WAITING
        self.topology: PrefillServerInfo | None = None
        self.ranks: dict[Cell, RankEntry] = {}
        self.last_error: str | None = None
        self.polls = 0

    @property
    def ready(self) -> bool:
        return self.state == READY

    async def poll(self) -> bool:
        """One read of the topology and every rank; True when something changed. BadResponse
        (an answer that is not SGLang's topology document: it names the field) propagates."""
        self.polls += 1
        before = (self.state, self.topology, dict(self.ranks))
        try:
            topo = await self.client.get_topology(self.host, self.port, refresh=True)
            found: dict[Cell, RankEntry] = {}
            for cell in cells(topo):
                addr = await self.client.get_rank_address(self.host, self.port, *cell,
                                                          use_cache=False)
                old = self.ranks.get(cell)
                same = old is not None and (old.rank_ip, old.rank_port) == (addr.rank_ip,
                                                                            addr.rank_port)
                found[cell] = old if same and old is not None else RankEntry(
                    addr.rank_ip, addr.rank_port, time.time(), None, None)
        except BootstrapNotReady as exc:
            # Before readiness SGLang answers 503 to every lookup; a restarted prefill too, and
            # its old addresses are stale then.
            self._set(NOT_READY, None, {}, exc.reason)
        except BadResponse as exc:
            if exc.status is not None and exc.status < 500:
                raise  # another kind of server (404, not JSON, not the document): fix the URL
            self._set(UNREACHABLE, self.topology, self.ranks, exc.reason)
        except BootstrapError as exc:
            # Unreachable: the engine's health check decides what that means; keep the table.
            self._set(UNREACHABLE, self.topology, self.ranks, exc.reason)
        else:
            self._set(READY, topo, found, None)
        return before != (self.state, self.topology, self.ranks)

    def _set(self, state: str, topo: PrefillServerInfo | None, ranks: dict[Cell, RankEntry],
             error: str | None) -> None:
        if state != self.state:
            log = logger.warning if state == UNREACHABLE else logger.info
            log("bootstrap %s:%d of %s: %s%s", self.host, self.port, self.instance_id, state,
                f" ({error})" if error else "")
        for cell in set(self.ranks) - set(ranks):
            self.keys.delete(self.layout.rank(self.instance_id, *cell))
        for cell, entry in ranks.items():
            self.keys.set(self.layout.rank(self.instance_id, *cell),
                          dumps(rank_value(cell, entry)))
        self.state, self.topology, self.ranks, self.last_error = state, topo, ranks, error
