"""Header helpers shared by the router's HTTP server and client."""
from __future__ import annotations

from collections.abc import Mapping

_NAMES: dict[bytes, str] = {}
_MAX_NAMES = 512


def header_name(raw: bytes) -> str:
    """A header name as a lower-case str. The same few names arrive on every request, so they
    are decoded once and then looked up (bounded: odd names are decoded every time)."""
    name = _NAMES.get(raw)
    if name is None:
        name = raw.decode("latin-1").lower()
        if len(_NAMES) < _MAX_NAMES and len(raw) <= 64:
            _NAMES[raw] = name
    return name


def decode_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """Raw header pairs as a dict with lower-case names (the last of duplicates wins)."""
    return {header_name(name): value.decode("latin-1") for name, value in raw}


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """Request header lines (latin-1, CRLF-terminated)."""
    return b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                    for name, value in headers.items())
