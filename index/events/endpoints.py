"""Endpoint rules of the KV-event transport (shared by publisher and subscriber).

A publisher binds when its endpoint host is a wildcard (``*``, ``0.0.0.0``, ``::``) or the
transport is ipc/inproc, and connects otherwise; so with ``tcp://127.0.0.1:P`` the consumer is the
one that binds. The replay ROUTER always binds. With data parallelism, DP rank N adds N to both
ports.
"""
from __future__ import annotations

import re

_TCP = re.compile(r"^tcp://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>\d+)$")
_WILDCARDS = {"*", "0.0.0.0", "::", "[::]"}


def parse_tcp(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://host:port`` endpoint, None for other transports."""
    m = _TCP.match(endpoint)
    if m is None:
        if endpoint.startswith("tcp://"):
            raise ValueError(f"bad tcp endpoint {endpoint!r}; expected tcp://HOST:PORT")
        if not endpoint.startswith(("ipc://", "inproc://")):
            raise ValueError(f"unsupported endpoint {endpoint!r}; use tcp://HOST:PORT, ipc:// or inproc://")
        return None
    port = int(m["port"])
    if not 0 < port < 65536:
        raise ValueError(f"port out of range in {endpoint!r}")
    return m["host"], port


def publisher_binds(endpoint: str) -> bool:
    """True when a publisher given ``endpoint`` binds it (so the consumer must connect)."""
    tcp = parse_tcp(endpoint)
    return tcp is None or tcp[0] in _WILDCARDS


def is_ipv6(endpoint: str) -> bool:
    tcp = parse_tcp(endpoint)
    return tcp is not None and (tcp[0].startswith("[") or tcp[0] == "::")


def connectable(endpoint: str) -> str:
    """``endpoint`` with a wildcard host replaced by loopback, for the side that connects."""
    tcp = parse_tcp(endpoint)
    if tcp is None or tcp[0] not in _WILDCARDS:
        return endpoint
    host = "[::1]" if tcp[0] in ("::", "[::]") else "127.0.0.1"
    return f"tcp://{host}:{tcp[1]}"


def bindable(endpoint: str) -> str:
    """``endpoint`` in the form ZMQ binds (``tcp://::`` needs brackets)."""
    tcp = parse_tcp(endpoint)
    if tcp is not None and tcp[0] == "::":
        return f"tcp://[::]:{tcp[1]}"
    return endpoint


def offset_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint of data-parallel rank ``dp_rank``: tcp ports shift by the rank; ipc/inproc
    paths get a ``_dp{N}`` suffix so that ranks never share one."""
    if dp_rank == 0:
        return endpoint
    tcp = parse_tcp(endpoint)
    if tcp is None:
        return f"{endpoint}_dp{dp_rank}"
    return f"tcp://{tcp[0]}:{tcp[1] + dp_rank}"
