"""The frame of kvatlas's binary etcd values: a 4-byte big-endian header length, a msgpack
header carrying its version ``"v"``, then raw buffers (``index.segments``, the routers' shared
predictions). Written once so that every such value is told apart the same way."""
from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

_LEN = struct.Struct(">I")

Refuse = Callable[[str, str], Exception]
"""Builds the caller's error from (reason, detail)."""


def pack(header: dict[str, Any], *buffers: bytes) -> bytes:
    head = msgpack.packb(header)
    return b"".join((_LEN.pack(len(head)), head, *buffers))


def unpack(raw: bytes, version: int, refuse: Refuse) -> tuple[dict[str, Any], memoryview]:
    """(header, the raw buffers after it) of a value of ``version``; ``refuse(reason, detail)``
    is raised for anything else (reasons ``truncated``, ``bad_header``, ``version``)."""
    if len(raw) < _LEN.size:
        raise refuse("truncated", f"{len(raw)} bytes")
    (n,) = _LEN.unpack_from(raw)
    try:
        header = msgpack.unpackb(raw[_LEN.size:_LEN.size + n])
    except (ValueError, msgpack.UnpackException) as exc:
        raise refuse("bad_header", str(exc)[:80]) from None
    if not isinstance(header, dict) or header.get("v") != version:
        raise refuse("version", f"not version {version}: {str(header)[:80]}")
    return header, memoryview(raw)[_LEN.size + n:]
