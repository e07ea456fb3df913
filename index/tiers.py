"""Cache tiers: where a matched block lives, and what a hit there is worth.

Engines publish a ``medium`` with their KV events (vLLM: ``GPU`` and, with CPU offloading,
``CPU``; SGLang's hierarchical cache: ``GPU``, ``CPU_PINNED``; storage backends: a disk or
remote name). The index keeps each block's medium per instance (``index.table``); a lookup
answers, per instance, how many blocks of its matched prefix sit in each tier. A device hit is
free, a host hit costs a copy to the device, a disk hit a read and a copy: the router credits
them by weight (defaults 1.0, 0.75, 0.25, as Dynamo weighs them).
"""
from __future__ import annotations

from dataclasses import dataclass

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)

_DEVICE_MEDIA = frozenset(("GPU", "CUDA", "HBM", "DEVICE", "NPU", "XPU"))


def tier_of(medium: str | None) -> str:
    """The tier of an event's ``medium``: None or a device name is the device; ``CPU``,
    ``CPU_PINNED`` (any ``CPU``/``HOST`` name) the host; anything else (``DISK``, ``SSD``,
    ``LOCAL_FILE``, a remote store) the disk tier."""
    if medium is None:
        return DEVICE
    name = medium.upper()
    if name in _DEVICE_MEDIA:
        return DEVICE
    if name.startswith(("CPU", "HOST", "DRAM")):
        return HOST
    return DISK


@dataclass(frozen=True)
class TierMatch:
    """One instance's matched prefix, in blocks per tier."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        """The matched prefix, every tier together."""
        return self.device + self.host + self.disk

    def credit(self, weights: TierWeights) -> float:
        """Blocks this match saves, weighed by tier."""
        return (self.device * weights.device + self.host * weights.host
                + self.disk * weights.disk)

    def as_dict(self) -> dict[str, int]:
        return {DEVICE: self.device, HOST: self.host, DISK: self.disk}


@dataclass(frozen=True)
class TierWeights:
    """What one matched block is worth per tier (1.0: as good as computed already)."""

    device: float = 1.0
    host: float = 0.75
    disk: float = 0.25

    def __post_init__(self) -> None:
        for name in TIERS:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} hit weight must be within [0, 1], got {value}")
