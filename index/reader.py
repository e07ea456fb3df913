"""``IndexReader``: what a reader of the block index (the router) may ask, and nothing more.

The router decides *which* model a request means (its config, the models its pools serve); the
index answers per model. Implemented by ``index.mirror.BlockMirror`` (the etcd mirror, one model
or all of them), ``index.sharded.ShardedIndex``, and the tests' ``memory_index.MemoryBlockIndex``
(one model, in process); one contract suite (tests/index/reader_contract.py) runs against each.

Method names differ from ``BlockIndex``'s (``lookup(hashes)``, ``instances()``) on purpose: both
classes implement both interfaces, and the older ones take no model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from index.tiers import TierMatch


@dataclass(frozen=True)
class InstanceDetail:
    """One instance as the index sees it."""

    instance_id: str
    blocks: Mapping[str, int]
    """Blocks held per model (only models where it holds at least one)."""
    changed_at: float
    """Unix time at which this process last applied a change of its blocks (a reload counts)."""


@dataclass(frozen=True)
class IndexStatus:
    """The index's state, for /health and the metrics."""

    ready: bool
    connected: bool
    blocks: int
    """Distinct blocks, summed over models (a block held by several instances counts once)."""
    revision: int = 0
    """etcd revision every event up to which is applied (0: not etcd-backed)."""
    revision_lag: int = 0
    disconnects: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class ShardStatus:
    """One shard of a block index spread over several etcd clusters (``index.sharded``)."""

    shard: int
    endpoint: str
    """The shard's etcd endpoints, as given (``HOST:PORT[,HOST:PORT...]``)."""
    status: IndexStatus
    instances: int
    """Instances holding blocks on this shard."""

    @property
    def state(self) -> str:
        """``loading`` (never loaded), ``stale`` (its last known state: etcd unreachable) or
        ``live``."""
        st = self.status
        return "live" if st.connected else ("stale" if st.ready else "loading")


class IndexReader(ABC):
    """Read side of the block index. Not thread-safe: read it on the loop that updates it."""

    model: str | None
    """The one model this index follows; None: every model (the caller names one per call)."""
    ready: bool
    """True once the first full state is loaded; before that every answer is empty."""

    @property
    @abstractmethod
    def connected(self) -> bool:
        """True while the index is kept current; False means answers are the last known state."""

    @abstractmethod
    def match(self, model: str, hashes: Sequence[int]) -> dict[str, int]:
        """``{instance: leading blocks of hashes it holds}`` in ``model``, longest prefix per
        instance; instances holding not even ``hashes[0]`` are left out. An unknown model
        answers ``{}`` (and asking must not make the index grow)."""

    @abstractmethod
    def match_tiers(self, model: str, hashes: Sequence[int]) -> dict[str, TierMatch]:
        """``match``, with each instance's matched prefix split by cache tier."""

    @abstractmethod
    def version(self, model: str | None = None) -> Hashable:
        """An opaque value that changes whenever ``match(model, ...)`` may answer differently
        (``model`` None: any model's). Equal values mean nothing changed in between."""

    @abstractmethod
    def models(self) -> frozenset[str]:
        """Models the index holds blocks of. A one-model index always lists its model."""

    @abstractmethod
    def block_count(self, model: str | None = None) -> int:
        """Distinct blocks of ``model`` (None: summed over models)."""

    @abstractmethod
    def instance_ids(self) -> frozenset[str]:
        """Instances holding at least one block, in any model."""

    @abstractmethod
    def instance(self, instance_id: str) -> InstanceDetail | None:
        """What the index holds of ``instance_id``; None when it holds no block of it."""

    @abstractmethod
    def status(self) -> IndexStatus:
        """Ready, connected, block count and (etcd-backed) revision figures."""

    def shards(self) -> list[ShardStatus]:
        """Per shard, its status, when the index is spread over several etcd clusters; empty
        when it is not (``status()`` says it all)."""
        return []
