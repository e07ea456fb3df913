"""The bootstrap server's one configuration dataclass."""
from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from bootstrap.http_limits import READ_TIMEOUT_S, check_read_timeout
from index.access import DEFAULT_LEASE_TTL, ClusterAccess
from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_instance_id, validate_model
from index.record import PREFILL, InstanceRecord

AUTH_TOKEN_ENV = "KVATLAS_AUTH_TOKEN"
"""Where ``--auth-token`` is read from when not given."""

DEFAULT_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


@dataclass
class BootstrapConfig:
    """Everything one bootstrap server needs; validated on construction."""

    instance_id: str
    """This prefill instance's id; names its etcd keys (``/kvatlas/v1/instances/{id}``)."""
    model: str
    """The model the instance serves, as routers and ``kvatlas instances`` show it."""
    host: str = "127.0.0.1"
    """Address to listen on. Loopback unless an operator opens it deliberately."""
    port: int = DEFAULT_PORT
    """TCP port to listen on (SGLang's default bootstrap port is 8998)."""
    advertise_host: str | None = None
    """Host that decodes should use to reach this server, as written to etcd (default: ``host``)."""
    etcd: EtcdSettings | None = None
    """How to reach etcd for the mirror; None serves from memory only, without a mirror."""
    etcd_prefix: str = DEFAULT_PREFIX
    """Key prefix in etcd."""
    auth_token: str | None = None
    """When set, PUT and POST need ``Authorization: Bearer <token>``; GETs stay open for decodes."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """TTL in seconds of the instance lease that all mirrored keys sit under (keepalive every TTL/3)."""
    dp_room_ttl: float = 120.0
    """Seconds a ``/register_dp_rank`` entry (room -> dp rank) lives."""
    dp_room_sweep_interval: float = 10.0
    """Seconds between sweeps that drop expired room entries."""
    dp_room_max_entries: int = 200_000
    """Most room entries kept; past it the oldest are evicted so a flood cannot exhaust memory."""
    max_body_bytes: int = 64 * 1024
    """Largest request body accepted; larger ones get 413."""
    read_timeout_s: float = READ_TIMEOUT_S
    """Seconds a client may take to send a request head, and then its body: a slower one
    (slowloris) is cut off, as on the engine's port (``bootstrap.http_limits``)."""
    instance_fields: dict[str, Any] = field(default_factory=dict)
    """More fields for the etcd instance record (``index.record.InstanceRecord``), e.g. ``url``,
    ``tp_size``: known names fill those fields, others are kept as extra fields; none can
    override what the server itself publishes (id, role, model, bootstrap address, ranks)."""
    access: ClusterAccess = field(init=False, repr=False, compare=False)
    """``etcd``, ``etcd_prefix`` and ``lease_ttl`` as one checked ``ClusterAccess``."""

    def __post_init__(self) -> None:
        validate_instance_id(self.instance_id)
        validate_model(self.model)
        if not self.host:
            raise ValueError("bootstrap host must not be empty (use 127.0.0.1 or 0.0.0.0)")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"bootstrap port {self.port} is outside 1-65535")
        self.access = ClusterAccess(etcd=self.etcd, prefix=self.etcd_prefix,
                                    lease_ttl=self.lease_ttl)
        if self.dp_room_ttl <= 0 or self.dp_room_sweep_interval <= 0:
            raise ValueError("dp room TTL and sweep interval must be positive")
        if self.dp_room_max_entries < 1:
            raise ValueError(f"dp room bound must be at least 1, got {self.dp_room_max_entries}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max body size must be at least 1024 bytes, got {self.max_body_bytes}")
        check_read_timeout(self.read_timeout_s)
        if self.auth_token is not None and not self.auth_token.strip():
            raise ValueError("auth token must not be empty; omit --auth-token to turn auth off")
        # A field of the wrong type fails here, not later on every publish of the record.
        InstanceRecord.build(self.instance_fields, instance_id=self.instance_id, role=PREFILL)

    @property
    def layout(self) -> KeyLayout:
        return self.access.layout

    @property
    def public_host(self) -> str:
        """The host decodes should dial: the advertised one, else the listen host."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            # A wildcard is not dialable; advertise this machine's name instead.
            return socket.getfqdn()
        return self.host

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add the server flags; the etcd flags are ``ClusterAccess.add_cli_args``."""
        parser.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
        parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                            help=f"listen port (default {DEFAULT_PORT})")
        parser.add_argument("--advertise-host", default=None,
                            help="host written to etcd for decodes to dial (default: --host)")
        parser.add_argument("--instance-id", required=True, help="this prefill instance's id")
        parser.add_argument("--model", required=True, help="the model the instance serves")
        parser.add_argument("--auth-token", default=None,
                            help="require 'Authorization: Bearer TOKEN' on PUT and POST "
                                 f"(default: ${AUTH_TOKEN_ENV}, which keeps it out of ps)")
        parser.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                            help=f"etcd lease TTL in seconds (default {DEFAULT_LEASE_TTL})")
        parser.add_argument("--dp-room-ttl", type=float, default=120.0,
                            help="seconds a room -> dp rank entry lives (default 120)")
        parser.add_argument("--dp-room-max-entries", type=int, default=200_000,
                            help="most room -> dp rank entries kept (default 200000)")
        parser.add_argument("--no-mirror", action="store_true",
                            help="serve from memory only, without the etcd mirror")
        parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                            help="seconds a client may take to send a request head, and then "
                                 f"its body (default {READ_TIMEOUT_S:g})")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      access: ClusterAccess | None = None) -> BootstrapConfig:
        """Build from parsed flags; ``access`` is what the CLI built from its etcd flags (None
        or ``--no-mirror``: no mirror)."""
        access = access or ClusterAccess()
        return cls(
            instance_id=args.instance_id,
            model=args.model,
            host=args.host,
            port=args.port,
            advertise_host=args.advertise_host,
            etcd=None if args.no_mirror else access.etcd,
            etcd_prefix=access.prefix,
            auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None,
            lease_ttl=args.lease_ttl,
            dp_room_ttl=args.dp_room_ttl,
            dp_room_max_entries=args.dp_room_max_entries,
            read_timeout_s=args.read_timeout,
        )
