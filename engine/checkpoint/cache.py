"""The on-disk cache of dequantized checkpoints: one safetensors file per source file.

Where: ``$KVATLAS_CACHE_DIR`` (default ``~/.cache/kvatlas``; an empty value disables the cache).
Key: the source's content hash plus a format version (tokenization/derived.py), so every copy of
a model file shares one entry. The file is written to a temporary name in the same directory and
renamed, so a reader never sees half a file and a failed write leaves nothing; a lock file makes
concurrent starts (TP ranks, PD halves) build it once while the others wait. A cache that cannot
be written is not an error: the caller keeps the arrays it computed.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenization.derived import cache_entry, publish_file

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

VERSION = "1"
"""Bumped when what is cached changes (names, layout, unpermuting)."""


def cache_file(source: Path) -> Path | None:
    """The cache file for ``source`` (None when the cache is disabled)."""
    entry = cache_entry(source, VERSION)
    return None if entry is None else entry.with_name(entry.name + ".safetensors")


def read_metadata(path: Path | None) -> dict[str, str] | None:
    """The ``__metadata__`` of a complete cache file, None when absent or unreadable (read from
    the safetensors header directly: no torch, no tensor data touched)."""
    if path is None:
        return None
    try:
        with path.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) and "kvatlas_config" in meta else None


@contextlib.contextmanager
def build_lock(path: Path | None) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (no-op without a cache or when the
    directory cannot be created)."""
    if path is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as e:
        logger.warning("checkpoint cache %s not usable (%s); loading without it", path.parent, e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write(path: Path | None, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> bool:
    """Write ``arrays`` to ``path`` atomically; False (logged) when it cannot be written."""
    if path is None:
        return False
    from safetensors.numpy import save_file

    try:
        publish_file(path, lambda tmp: save_file(arrays, str(tmp), metadata=metadata))
    except OSError as e:
        logger.warning("could not write checkpoint cache %s: %s", path, e)
        return False
    logger.info("checkpoint cache written: %s", path)
    return True


def load(path: Path) -> dict[str, torch.Tensor]:
    """The cached tensors (memory-mapped by safetensors)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def describe(path: Path | None) -> dict[str, Any]:
    """What a cache entry holds, for logs and doctor output."""
    meta = read_metadata(path)
    return {"path": str(path) if path else None, "present": meta is not None,
            "source": meta.get("source") if meta else None}
