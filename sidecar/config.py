"""The sidecar's one config dataclass (``kvatlas sidecar`` flags)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from bootstrap.config import DEFAULT_PORT as BOOTSTRAP_PORT
from index.access import DEFAULT_LEASE_TTL, ClusterAccess
from index.etcd import EtcdSettings
from index.events.endpoints import offset_endpoint
from index.events.subscriber import SubscriberConfig
from index.hashing import DEFAULT_BLOCK_SIZE
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_instance_id, validate_model
from index.pd_protocol import CHOICES as PD_CHOICES
from index.pd_protocol import (
    NIXL_PORT,
    PUSH,
    SGLANG_BOOTSTRAP,
    PDProtocol,
    ProtocolFieldError,
)
from index.record import AGGREGATED, DECODE, PREFILL
from index.shards import IndexShards

ROLES = (PREFILL, DECODE, AGGREGATED)
SGLANG, VLLM = "sglang", "vllm"
ENGINES = (SGLANG, VLLM)
"""What the sidecar can stand beside: SGLang (``/get_server_info``, bootstrap server for PD) or
vLLM (``/v1/models``; PD through its NixlConnector's ``kv_transfer_params``)."""
NIXL_FIELDS = {"engine_id": "nixl_engine_id", "host": "nixl_host", "port": "nixl_port",
               "tp_size": "tp_size"}
"""A vLLM prefill's identity: each ``PDProtocol`` field and the config field (and so the
flag, ``_flag``) that gives it."""


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def http_base(url: str, flag: str) -> tuple[str, str, int]:
    """(normalized base URL, host, port) of an ``http(s)://HOST:PORT`` flag; ValueError naming
    ``flag`` otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag} must be http(s)://HOST:PORT, got {url!r}")
    if parts.path.strip("/") or parts.query:
        raise ValueError(f"{flag} must be a base URL without a path, got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"{flag} has an invalid port: {url!r}") from None
    host = parts.hostname
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}:{port}", host, port


@dataclass
class SidecarConfig:
    """One sidecar: one foreign engine instance."""

    instance_id: str
    """The instance id routers and the block index know the engine by."""
    role: str
    """``prefill``, ``decode`` or ``aggregated`` (serves whole requests; no PD pair)."""
    engine_url: str
    """The engine's HTTP base URL (the record's ``url``: where routers send requests)."""
    model: str
    """The model the engine serves (part of every block key; routers filter on it)."""
    engine: str = SGLANG
    """The engine kind: ``sglang`` or ``vllm`` (how it is probed, what the record says)."""
    bootstrap_url: str | None = None
    """Prefill: its SGLang bootstrap server (default: the engine's host, port 8998)."""
    pd_protocol: PDProtocol | None = None
    """A PD instance's protocol (``--pd-protocol``): None reads as SGLang's bootstrap for
    ``--engine sglang`` and vLLM's pull mode for ``--engine vllm``. After ``__post_init__`` a
    vLLM prefill's carries its NIXL identity (the ``nixl_*`` and ``tp_size`` fields)."""
    nixl_engine_id: str | None = None
    """vLLM prefill: its ``kv_transfer_config.engine_id`` (decodes name it as
    ``remote_engine_id``); required in push mode, since vLLM's default is a fresh uuid per
    start that no router can know in advance."""
    nixl_host: str | None = None
    """vLLM prefill: its NIXL side channel's host (``VLLM_NIXL_SIDE_CHANNEL_HOST``; default:
    the engine URL's host)."""
    nixl_port: int | None = None
    """vLLM prefill: its NIXL side channel's port (``VLLM_NIXL_SIDE_CHANNEL_PORT``; default
    5600, vLLM's)."""
    tp_size: int | None = None
    """vLLM prefill: its tensor-parallel size, which decodes map their ranks onto (default 1)."""
    events: SubscriberConfig | None = None
    """The KV events of attention-DP rank 0 (rank r: port + r); None: not indexed."""
    dp_size: int = 1
    """Attention-DP ranks whose KV events are subscribed, for one instance."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Index block size in tokens: the engine's page size must equal it (SGLang
    ``--page-size``), or every event is refused as the wrong block size."""
    tokenizer: str | None = None
    """The tokenizer the engine uses (a path or alias), named in the record so routers hash as
    the engine does; None: the one the engine's ``/get_server_info`` names, if any."""
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    """The etcd cluster holding the instance records and the index."""
    etcd_prefix: str = DEFAULT_PREFIX
    """Key prefix of every key written."""
    index_etcd: IndexShards = field(default_factory=IndexShards)
    """The etcd clusters the block index is spread over (``--index-etcd``); none: ``etcd``."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """Seconds the instance's keys outlive the sidecar."""
    health_interval: float = 0.5
    """Seconds between ``/health`` checks of the engine."""
    health_timeout: float = 2.0
    """Seconds one ``/health`` check may take before it counts as failed (SGLang's may run a
    one-token generation: give it time under load)."""
    unhealthy_after: int = 2
    """Consecutive failed checks that mark the engine unhealthy in its record (a dead engine,
    whose port refuses: within about n * interval; a hung one: within interval + n * (timeout +
    interval))."""
    unhealthy_grace: float = 20.0
    """Seconds an unhealthy engine keeps its record and blocks before the lease is revoked."""
    bootstrap_poll: float = 0.5
    """Seconds between reads of the prefill's bootstrap topology and ranks."""
    publisher_wait: float = 5.0
    """Seconds to wait, after binding the KV-event endpoints, for the engine's publisher (each
    DP rank's) to connect before the record makes the instance routable: what an engine
    publishes before its subscriber is connected is lost, and with nothing published after it
    no gap ever shows. Past it the sidecar goes on and says which endpoint has no publisher;
    0: do not wait."""
    access: ClusterAccess = field(init=False, repr=False, compare=False)
    """``etcd``, ``etcd_prefix``, ``index_etcd`` and ``lease_ttl`` as one checked
    ``ClusterAccess``."""

    def __post_init__(self) -> None:
        validate_instance_id(self.instance_id)
        validate_model(self.model)
        if self.role not in ROLES:
            raise ValueError(f"--role must be one of {list(ROLES)}, got {self.role!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {list(ENGINES)}, got {self.engine!r}")
        self.engine_url, host, _ = http_base(self.engine_url, "--engine-url")
        self._check_pd_protocol(host)
        if self.role == AGGREGATED:
            # No PD pair: nobody asks a bootstrap server for its ranks.
            if self.bootstrap_url is not None:
                raise ValueError("--bootstrap-url is for SGLang prefills: an aggregated "
                                 "instance runs no bootstrap server")
        elif self.role == DECODE:
            if self.bootstrap_url is not None:
                raise ValueError("--bootstrap-url is for prefills: a decode runs no bootstrap "
                                 "server")
            if self.events is not None:
                raise ValueError("--kv-events is for prefills: a decode's cache is not indexed")
        elif self.bootstrap_url is None and self.engine == SGLANG:
            shown = f"[{host}]" if ":" in host else host
            self.bootstrap_url = f"http://{shown}:{BOOTSTRAP_PORT}"
        if self.bootstrap_url is not None:
            self.bootstrap_url = http_base(self.bootstrap_url, "--bootstrap-url")[0]
        if not 1 <= self.dp_size <= 1024:
            raise ValueError(f"--dp-size must be within [1, 1024], got {self.dp_size}")
        if not 1 <= self.block_size <= 65536:
            raise ValueError(f"--block-size must be within [1, 65536], got {self.block_size}")
        self.access = ClusterAccess(etcd=self.etcd, prefix=self.etcd_prefix,
                                    index_shards=self.index_etcd, lease_ttl=self.lease_ttl)
        for name, lo, hi in (("health_interval", 0.05, 60.0), ("health_timeout", 0.05, 60.0),
                             ("unhealthy_grace", 0.0, 86400.0), ("bootstrap_poll", 0.05, 60.0),
                             ("publisher_wait", 0.0, 60.0)):
            value = getattr(self, name)
            if not lo <= value <= hi:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be within [{lo:g}, {hi:g}] s, got {value}")
        if not 1 <= self.unhealthy_after <= 100:
            raise ValueError(f"--unhealthy-after must be within [1, 100], got "
                             f"{self.unhealthy_after}")
        if self.events is not None and self.events.model is None:
            self.events = SubscriberConfig(
                endpoint=self.events.endpoint, replay_endpoint=self.events.replay_endpoint,
                topic=self.events.topic, connect=self.events.connect, model=self.model)

    def _check_pd_protocol(self, engine_host: str) -> None:
        """Settle ``pd_protocol`` (with a vLLM prefill's NIXL identity); ValueError naming the
        flag to change."""
        given = [_flag(attr) for attr in NIXL_FIELDS.values() if getattr(self, attr) is not None]
        if self.engine == SGLANG:
            if self.pd_protocol not in (None, SGLANG_BOOTSTRAP):
                raise ValueError(f"--pd-protocol {self.pd_protocol.label} is vLLM's: give "
                                 "--engine vllm, or leave --pd-protocol out for SGLang")
            if given:
                raise ValueError(f"{', '.join(given)}: vLLM prefill flags; SGLang's identity "
                                 "comes from its bootstrap server (--bootstrap-url)")
            self.pd_protocol = None
            return
        if self.role == AGGREGATED:
            if self.pd_protocol is not None or given:
                raise ValueError(f"{', '.join(given) or '--pd-protocol'}: for a vLLM prefill or "
                                 "decode; an aggregated instance has no PD pair")
            return
        if self.bootstrap_url is not None:
            raise ValueError("--bootstrap-url is SGLang's: a vLLM prefill is reached through "
                             "its NIXL side channel (--nixl-host, --nixl-port)")
        proto = self.pd_protocol or PDProtocol("vllm")
        if proto.name != VLLM:
            raise ValueError(f"--pd-protocol {proto.label} with --engine vllm: give vllm-pull "
                             "or vllm-push (as the engine's kv_connector: NixlConnector or "
                             "NixlPushConnector)")
        if self.role == DECODE:
            if given:
                raise ValueError(f"{', '.join(given)}: for a vLLM prefill (a decode names "
                                 "its prefill per request; routers read the prefill's record)")
            self.pd_protocol = PDProtocol(VLLM, proto.mode)
            return
        if proto.mode == PUSH and self.nixl_engine_id is None:
            raise ValueError("--pd-protocol vllm-push needs --nixl-engine-id: the decode names "
                             "the prefill before it answers, and vLLM's default engine_id is a "
                             "fresh uuid per start; set one in the prefill's "
                             "--kv-transfer-config (\"engine_id\") and pass it here")
        try:
            self.pd_protocol = PDProtocol(
                VLLM, proto.mode, engine_id=self.nixl_engine_id,
                host=self.nixl_host if self.nixl_host is not None else engine_host,
                port=self.nixl_port if self.nixl_port is not None else NIXL_PORT,
                tp_size=self.tp_size if self.tp_size is not None else 1)
        except ProtocolFieldError as exc:
            attr = NIXL_FIELDS.get(exc.field)
            raise ValueError(f"{_flag(attr) if attr else '--pd-protocol'}: {exc}") from None

    @property
    def layout(self) -> KeyLayout:
        return self.access.layout

    def event_sources(self) -> list[tuple[int, SubscriberConfig]]:
        """Per attention-DP rank, where its KV events come from (SGLang: port + rank)."""
        ev = self.events
        if ev is None:
            return []
        return [(dp, SubscriberConfig(
            endpoint=offset_endpoint(ev.endpoint, dp),
            replay_endpoint=(None if ev.replay_endpoint is None
                             else offset_endpoint(ev.replay_endpoint, dp)),
            topic=ev.topic, connect=ev.connect, model=ev.model)) for dp in range(self.dp_size)]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Sidecar flags (etcd flags are the CLI's own)."""
        d = cls
        parser.add_argument("--instance-id", required=True, help="the engine's instance id")
        parser.add_argument("--role", required=True, choices=ROLES,
                            help="prefill or decode (an SGLang PD pair), aggregated (serves whole "
                                 "requests)")
        parser.add_argument("--engine", default=SGLANG, choices=ENGINES,
                            help=f"the engine beside the sidecar (default {SGLANG}); vllm: "
                                 "probed through /health and /v1/models")
        parser.add_argument("--engine-url", required=True, metavar="URL",
                            help="the engine's HTTP base URL, e.g. http://10.0.0.5:30000")
        parser.add_argument("--model", required=True, help="the model the engine serves")
        parser.add_argument("--pd-protocol", default=None, choices=PD_CHOICES,
                            help="vLLM prefill or decode: vllm (= vllm-pull, NixlConnector) or "
                                 "vllm-push (NixlPushConnector); default: sglang for --engine "
                                 "sglang, vllm-pull for --engine vllm")
        parser.add_argument("--nixl-engine-id", default=None, metavar="ID",
                            help="vLLM prefill: its kv_transfer_config engine_id (required "
                                 "for vllm-push)")
        parser.add_argument("--nixl-host", default=None, metavar="HOST",
                            help="vLLM prefill: VLLM_NIXL_SIDE_CHANNEL_HOST (default: the "
                                 "engine URL's host)")
        parser.add_argument("--nixl-port", type=int, default=None, metavar="PORT",
                            help=f"vLLM prefill: VLLM_NIXL_SIDE_CHANNEL_PORT (default "
                                 f"{NIXL_PORT})")
        parser.add_argument("--tp-size", type=int, default=None, metavar="N",
                            help="vLLM prefill: its tensor-parallel size (default 1)")
        parser.add_argument("--bootstrap-url", default=None, metavar="URL",
                            help="prefill: its SGLang bootstrap server (default: the engine's "
                                 f"host, port {BOOTSTRAP_PORT})")
        parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                            help="prefill or aggregated: the endpoint in the engine's "
                                 "--kv-events-config (a concrete host: the engine connects, the "
                                 "sidecar binds; vLLM's tcp://*:P: the sidecar connects)")
        parser.add_argument("--replay", default=None, metavar="ENDPOINT",
                            help="the engine's KV-event replay endpoint, if it has one")
        parser.add_argument("--topic", default="", help="KV-event topic prefix (default: all)")
        parser.add_argument("--kv-events-connect", default=None,
                            action=argparse.BooleanOptionalAction,
                            help="force connect (or --no-kv-events-connect: bind) instead of the "
                                 "rule")
        parser.add_argument("--dp-size", type=int, default=1,
                            help="attention-DP ranks publishing KV events (rank r on port + r)")
        parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                            help=f"index block size (default {DEFAULT_BLOCK_SIZE}); the engine's "
                                 "page size must equal it")
        parser.add_argument("--tokenizer", default=None, metavar="PATH",
                            help="the engine's tokenizer (a tokenizer.json directory, a GGUF or "
                                 "an alias), named in the record for routers")
        parser.add_argument("--lease-ttl", type=int, default=d.lease_ttl,
                            help=f"seconds the keys outlive the sidecar (default {d.lease_ttl})")
        parser.add_argument("--health-interval", type=float, default=d.health_interval,
                            help=f"seconds between /health checks (default {d.health_interval})")
        parser.add_argument("--health-timeout", type=float, default=d.health_timeout,
                            help=f"seconds per /health check (default {d.health_timeout})")
        parser.add_argument("--unhealthy-after", type=int, default=d.unhealthy_after,
                            help="failed checks in a row that mark the engine unhealthy "
                                 f"(default {d.unhealthy_after})")
        parser.add_argument("--unhealthy-grace", type=float, default=d.unhealthy_grace,
                            help="seconds unhealthy before the lease is revoked "
                                 f"(default {d.unhealthy_grace:g})")
        parser.add_argument("--bootstrap-poll", type=float, default=d.bootstrap_poll,
                            help=f"seconds between bootstrap table reads (default "
                                 f"{d.bootstrap_poll})")
        parser.add_argument("--publisher-wait", type=float, default=d.publisher_wait,
                            help="seconds to wait for the engine's KV-event publisher to connect "
                                 "before the instance is made routable (default "
                                 f"{d.publisher_wait:g}; 0: do not wait)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      access: ClusterAccess | None = None) -> SidecarConfig:
        """Build from parsed flags; ``access`` is what the CLI built from its etcd flags
        (None: the default etcd and prefix)."""
        access = access or ClusterAccess()
        events = None
        if args.kv_events is not None:
            events = SubscriberConfig(endpoint=args.kv_events, replay_endpoint=args.replay,
                                      topic=args.topic, connect=args.kv_events_connect)
        elif args.replay is not None:
            raise ValueError("--replay needs --kv-events")
        return cls(instance_id=args.instance_id, role=args.role, engine_url=args.engine_url,
                   model=args.model, engine=args.engine, bootstrap_url=args.bootstrap_url,
                   pd_protocol=(None if args.pd_protocol is None
                                else PDProtocol.parse(args.pd_protocol)),
                   nixl_engine_id=args.nixl_engine_id, nixl_host=args.nixl_host,
                   nixl_port=args.nixl_port, tp_size=args.tp_size,
                   events=events, dp_size=args.dp_size, block_size=args.block_size,
                   tokenizer=args.tokenizer,
                   etcd=access.main_etcd, etcd_prefix=access.prefix,
                   lease_ttl=args.lease_ttl, health_interval=args.health_interval,
                   health_timeout=args.health_timeout, unhealthy_after=args.unhealthy_after,
                   unhealthy_grace=args.unhealthy_grace, bootstrap_poll=args.bootstrap_poll,
                   publisher_wait=args.publisher_wait,
                   index_etcd=access.index_shards)
