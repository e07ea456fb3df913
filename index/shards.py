"""Where the block index lives: one etcd, or several etcd clusters (*shards*) it is spread over.

One etcd carries the block changes of a few hundred busy prefills (docs/performance.md, "How far
the index goes"). Past that, ``--index-etcd`` names more clusters and the block segments are spread over
them, one instance's blocks all on one shard. Everything else (instance records, rank tables,
rooms, the routers' predictions) stays in the main etcd (``--etcd``): it is small and every
component reads it.

Placement is rendezvous hashing: an instance goes to the shard whose ``xxh64(instance_id, seed=
shard index)`` is highest. It is a pure function of the id and the shard count, the same in every
process and every run, and adding a shard moves only the instances the new shard wins (1/N of
them), never one between two old shards. Every process must list the shards in the same order;
a writer that lists them differently writes to another shard, which routers still read (they
mirror every shard), so a mismatch costs balance, never correctness.

A router mirrors every shard (``index.sharded.ShardedIndex``): a shard that is down leaves only
its own instances' blocks stale, flagged per shard in the router's readiness and metrics.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from index.etcd import EtcdSettings, parse_endpoints

MAX_SHARDS = 64
"""More clusters than any deployment needs (each carries hundreds of instances): a longer list
is a typo, not a plan."""


@dataclass(frozen=True)
class IndexShards:
    """The etcd clusters the block index is spread over (none: it lives in the main etcd)."""

    clusters: tuple[EtcdSettings, ...] = ()
    """One ``EtcdSettings`` per shard, in the order every process lists them; empty: the block
    index lives in the main etcd, as one shard."""

    def __post_init__(self) -> None:
        if len(self.clusters) > MAX_SHARDS:
            raise ValueError(f"--index-etcd names {len(self.clusters)} clusters; at most "
                             f"{MAX_SHARDS} are supported")
        seen: dict[str, int] = {}
        for i, c in enumerate(self.clusters):
            for ep in c.endpoints:
                if ep in seen:
                    raise ValueError(f"--index-etcd lists endpoint {ep} in shard {seen[ep]} and "
                                     f"shard {i}: each cluster must appear once")
                seen[ep] = i

    @classmethod
    def from_texts(cls, texts: Sequence[str], base: EtcdSettings) -> IndexShards:
        """Parse ``--index-etcd`` values (each ``HOST:PORT[,HOST:PORT...]``, one cluster), each
        reached with ``base``'s timeout, credentials and TLS files."""
        clusters = []
        for text in texts:
            try:
                endpoints = parse_endpoints(text)
            except ValueError as exc:
                raise ValueError(f"--index-etcd {text!r}: {exc}") from None
            clusters.append(dataclasses.replace(base, endpoints=endpoints))
        return cls(tuple(clusters))

    @property
    def sharded(self) -> bool:
        """True when the blocks live apart from the main etcd."""
        return bool(self.clusters)

    @property
    def count(self) -> int:
        """Shards the block index has (1 when it lives in the main etcd)."""
        return max(1, len(self.clusters))

    def place(self, instance_id: str) -> int:
        """The shard holding ``instance_id``'s blocks (0 when not sharded)."""
        n = len(self.clusters)
        if n <= 1:
            return 0
        raw = instance_id.encode()
        return max(range(n), key=lambda i: xxhash.xxh64_intdigest(raw, seed=i))

    def shard_settings(self, main: EtcdSettings) -> list[EtcdSettings]:
        """Every shard's settings, in order (``[main]`` when not sharded)."""
        return list(self.clusters) or [main]

    def describe(self) -> str:
        return " | ".join(c.display for c in self.clusters) or "the main etcd"

    @staticmethod
    def add_cli_args(group: argparse._ActionsContainer) -> None:
        group.add_argument(
            "--index-etcd", action="extend", nargs="+", default=None,
            metavar="HOST:PORT[,HOST:PORT...]",
            help="etcd clusters to spread the block index over, one value per cluster (commas "
                 "join one cluster's members); every process lists them in the same order. "
                 "Default: the block index lives in --etcd")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, etcd: EtcdSettings) -> IndexShards:
        """From ``--index-etcd`` (absent: not sharded), with ``etcd``'s credentials and TLS."""
        return cls.from_texts(args.index_etcd or (), etcd)
