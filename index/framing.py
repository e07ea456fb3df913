"""The frame of kvatlas's binary etcd values: a 4-byte big-endian header length, a msgpack
header carrying its version ``"v"``, then raw buffers (``index.segments``, the routers' shared
predictions). Written once so that every such value is told apart the same way."""
from __future__ import annotations

import math
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
    is raised for anything else (reasons ``truncated``, ``bad_header``, ``version``), and nothing
    else is: the value comes from etcd, where any bytes can be."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise refuse("truncated", f"not bytes but {type(raw).__name__}")
    if len(raw) < _LEN.size:
        raise refuse("truncated", f"{len(raw)} bytes")
    (n,) = _LEN.unpack_from(raw)
    if n > len(raw) - _LEN.size:
        raise refuse("truncated", f"a {n}-byte header in {len(raw)} bytes")
    try:
        header = msgpack.unpackb(raw[_LEN.size:_LEN.size + n])
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds on garbage
        raise refuse("bad_header", f"{type(exc).__name__}: {str(exc)[:80]}") from None
    v = header.get("v") if isinstance(header, dict) else None
    # type(): True == 1, and a bool is no version.
    if type(v) is not int or v != version:
        raise refuse("version", f"not version {version}: {str(header)[:80]}")
    return header, memoryview(raw)[_LEN.size + n:]


def strict_int(value: Any, lo: int, hi: int) -> bool:
    """Whether ``value`` is an int (not a bool: msgpack's true is Python's True, which is an
    int) within [lo, hi]: how every header field that sizes or indexes a buffer is checked."""
    return type(value) is int and lo <= value <= hi


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (not a bool, NaN or infinity)."""
    return (type(value) is float and math.isfinite(value)) or type(value) is int
