"""The router's one config dataclass, with flags that mirror sglang-router's PD mode.

Its settings are grouped by concern, each with its flags: routing (router/routing_config.py),
worker health, breakers and retries (router/resilience_config.py), and here the process's own
(listening, discovery, static workers, admission and limits)."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from index.access import ClusterAccess
from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_model
from index.pd_protocol import CHOICES as PD_CHOICES
from index.pd_protocol import PDProtocol
from index.shards import IndexShards
from router.resilience_config import ResilienceSettings, add_resilience_args, resilience_kwargs
from router.routing_config import (
    RoutingSettings,
    add_kv_aware_args,
    add_policy_args,
    routing_kwargs,
)
from tokenization import BYTE, TokenizerError, can_load, canonical_model
from tokenization.assets import KNOWN_NAMES, is_known

ADMIN_TOKEN_ENV = "KVATLAS_ADMIN_TOKEN"
"""Where ``--admin-token`` is read from when not given."""

MAX_PORT = 65535


def check_url(url: str) -> str:
    """``url`` without a trailing slash; raises ValueError unless it is http(s)://host:port."""
    if not isinstance(url, str):
        raise ValueError(f"worker URL must be a string, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
    try:
        _ = parts.port  # urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(f"worker URL {url!r} has an invalid port") from None
    return url.rstrip("/")


def parse_tokenizer_flags(items: list[str]) -> dict[str | None, str]:
    """``--tokenizer`` values: ``PATH`` (the tokenizer of every model without its own) or
    ``MODEL=PATH``. An item that is itself an existing path is a path even with a ``=`` in it."""
    out: dict[str | None, str] = {}
    for item in items:
        model, sep, source = item.partition("=")
        if not sep or not model or Path(item).exists():
            model, source = None, item  # type: ignore[assignment]
        if not source:
            raise ValueError(f"--tokenizer {item!r}: give PATH or MODEL=PATH")
        key = canonical_model(model) if model else None
        if key in out:
            raise ValueError(f"--tokenizer given twice for "
                             f"{'model ' + repr(key) if key else 'the default model'}")
        out[key] = source
    return out


def check_tokenizer_source(source: str) -> str:
    """``source`` when it can name a tokenizer here ("byte", a known alias, an existing path);
    TokenizerError naming it otherwise, at start-up rather than at the first request."""
    if not can_load(source):
        raise TokenizerError(source, "no such file or directory (give a directory with "
                                     "tokenizer.json, a .gguf file, 'byte' or an alias: "
                                     f"{', '.join(KNOWN_NAMES)})")
    return source if source == BYTE or is_known(source) else str(Path(source).expanduser())


def parse_bootstrap_port(text: str | int | None) -> int | None:
    """sglang-router's optional bootstrap port: an int, or ``none``/None (the prefill default)."""
    if text is None or (isinstance(text, str) and text.lower() in ("none", "null", "")):
        return None
    try:
        port = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"bootstrap port {text!r} must be an integer or 'none'") from None
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"bootstrap port must be within [1, {MAX_PORT}], got {port}")
    return port


@dataclass
class RouterConfig(RoutingSettings, ResilienceSettings):
    """Everything a router process needs; the CLI only parses flags into this. The routing and
    resilience fields are inherited: ``RouterConfig(policy=..., retry_max_attempts=...)``."""

    host: str = "127.0.0.1"
    """Address to listen on (loopback unless configured)."""
    port: int = 8000
    """HTTP port."""
    etcd: EtcdSettings | None = None
    """etcd to discover workers and follow the block index from; None: static workers only."""
    etcd_prefix: str = DEFAULT_PREFIX
    """Key prefix of the kvatlas keys in etcd."""
    index_etcd: IndexShards = field(default_factory=IndexShards)
    """The etcd clusters the block index is spread over (``--index-etcd``), each followed by a
    mirror of its own; none: the block index is followed in ``etcd``."""
    model: str | None = None
    """Served model name: only instances of this model join the pools, and its block index is
    followed. None: every model (the request's ``model`` picks the hash namespace). An alias
    (``smollm2-135m``) is taken as its canonical name, as requests' and records' models are."""
    tokenizers: dict[str | None, str] = field(default_factory=dict)
    """Per model (``None``: every model without its own), where its tokenizer is loaded from:
    a directory with ``tokenizer.json``, a ``.gguf`` file, an alias, or ``"byte"``. A model
    with none here takes the tokenizer its instance records name, when this host can load it;
    a model with neither is routed on load alone (its text prompts cannot be hashed into the
    engines' block ids), with a warning and ``kvatlas_router_untokenizable_models``."""
    prefill: list[tuple[str, int | None]] = field(default_factory=list)
    """Static prefill workers: (URL, bootstrap port or None for the prefill's default 8998)."""
    decode: list[str] = field(default_factory=list)
    """Static decode worker URLs."""
    pd_protocol: str = "sglang"
    """The PD protocol of the static ``prefill``/``decode`` workers (``index.pd_protocol``):
    ``sglang`` (bootstrap fields) or ``vllm``/``vllm-pull`` (``kv_transfer_params``, as vLLM's
    own proxy drives a pair). vLLM's push mode names each prefill's identity in advance, so
    its prefills come from records (``kvatlas sidecar --engine vllm --role prefill``)."""
    worker_urls: list[str] = field(default_factory=list)
    """Static aggregated workers (sglang-router's regular mode, ``--worker-urls``): each serves
    whole requests, sent as received with no bootstrap fields."""
    admin_token: str | None = None
    """Token required by POST/DELETE /workers (``Authorization: Bearer T``); None: admin off."""
    forward_client_auth: bool = False
    """Forward the client's ``Authorization`` and ``Cookie`` headers to the workers. Off by
    default: a worker is whatever URL an etcd record names, so a client's credentials would
    go to anyone able to write a record (turn it on only for engines that check them)."""
    max_body: int = 8 << 20
    """Largest request body in bytes (413 above). The reference engine's default
    ``--max-request-bytes``: a body the router takes is one its workers take too."""
    max_tokens: int = 1 << 20
    """Largest max_new_tokens / max_tokens a request may ask for (400 above)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (400 above, before tokenizing ends or a worker is asked); the
    workers' own limits apply as well, learned from their records or ``/server_info``
    (router/limits.py). None: only the workers' limits."""
    client_read_timeout: float = 60.0
    """Seconds a client has to send a whole request once its first byte arrived (408 after):
    a client trickling bytes cannot hold a connection forever."""
    request_id_headers: tuple[str, ...] = ("x-request-id",)
    """Headers a client's request id is read from, first found wins; it is forwarded and
    returned as ``x-request-id`` (one is made when none came)."""
    max_concurrent_requests: int = -1
    """Proxied requests served at once; past it they queue (-1: no limit)."""
    queue_size: int = 100
    """Requests that may wait for a slot; past it, 429 at once."""
    queue_timeout: float = 60.0
    """Seconds a request may wait for a slot (408 after)."""
    worker_admission: bool = True
    """Put no more on a worker than it states it holds (``max_running_requests``, KV pool): the
    rest wait at the router (router/capacity.py). False: forward everything at once."""
    worker_queue_size: int = 256
    """Requests that may wait for a worker with room; past it, 429 with ``Retry-After``."""
    worker_queue_timeout: float = 30.0
    """Seconds a request may wait for a worker with room (408 with ``Retry-After`` after)."""
    shutdown_grace: float = 30.0
    """Seconds a stopping router lets requests in flight finish (streams included) before it
    cuts them."""
    prometheus_port: int | None = None
    """Also serve ``/metrics`` on this port (sglang-router's separate metrics port); None: on
    the main port only."""
    prometheus_host: str = "127.0.0.1"
    """Address of the ``prometheus_port`` listener."""
    uvloop: bool = True
    """Run on uvloop when it is installed (the CLI's --no-uvloop turns it off)."""
    access: ClusterAccess = field(init=False, repr=False, compare=False)
    """``etcd``, ``etcd_prefix`` and ``index_etcd`` as one checked ``ClusterAccess``."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be within [0, {MAX_PORT}], got {self.port}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= MAX_PORT:
            raise ValueError(f"prometheus port must be within [0, {MAX_PORT}], got "
                             f"{self.prometheus_port}")
        self.access = ClusterAccess(etcd=self.etcd, prefix=self.etcd_prefix,
                                    index_shards=self.index_etcd)
        if self.model is not None:
            self.model = canonical_model(self.model)
            validate_model(self.model)
        self.tokenizers = {None if m is None else canonical_model(m): check_tokenizer_source(s)
                           for m, s in self.tokenizers.items()}
        RoutingSettings.__post_init__(self)
        ResilienceSettings.__post_init__(self)
        self.prefill = [(check_url(u), parse_bootstrap_port(p)) for u, p in self.prefill]
        self.decode = [check_url(u) for u in self.decode]
        protocol = PDProtocol.parse(self.pd_protocol)
        if protocol.missing_identity():
            raise ValueError("--pd-protocol vllm-push needs each prefill's NIXL engine id, side "
                             "channel and TP size, which static --prefill URLs do not give: "
                             "register the prefills with `kvatlas sidecar --engine vllm --role "
                             "prefill --pd-protocol vllm-push ...` and route with --etcd, or use "
                             "--pd-protocol vllm (pull) for static workers")
        self.worker_urls = [check_url(u) for u in self.worker_urls]
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin token must be at least 8 characters")
        for name in ("max_body", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("client_read_timeout", "worker_queue_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("shutdown_grace", "queue_size", "queue_timeout", "worker_queue_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.request_id_headers = tuple(h.strip().lower() for h in self.request_id_headers)
        if not self.request_id_headers or not all(self.request_id_headers):
            raise ValueError("request_id_headers needs at least one non-empty header name")

    @property
    def layout(self) -> KeyLayout:
        return self.access.layout

    # --- CLI ----------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Router flags; the etcd flags (--etcd, --etcd-prefix, TLS) are added by the caller."""
        d = cls()
        parser.add_argument("--host", default=d.host, help=f"listen address (default {d.host})")
        parser.add_argument("--port", type=int, default=d.port, help=f"port (default {d.port})")
        parser.add_argument("--model", default=None, help="served model name (default: any)")
        parser.add_argument("--tokenizer", action="append", default=[],
                            metavar="PATH|MODEL=PATH",
                            help="tokenizer whose ids the engines prefill: a directory with "
                                 "tokenizer.json, a .gguf file, an alias (smollm2-135m) or "
                                 "'byte'; MODEL=PATH for one model, repeatable (default: the "
                                 "one the instance records name; none: load-only routing)")
        add_policy_args(parser)
        parser.add_argument("--prefill", nargs="+", action="append", default=[],
                            metavar="URL [BOOTSTRAP_PORT|none]",
                            help="static prefill worker, repeatable")
        parser.add_argument("--decode", action="append", default=[], metavar="URL",
                            help="static decode worker, repeatable")
        parser.add_argument("--pd-protocol", default="sglang", choices=PD_CHOICES,
                            help="how the static --prefill/--decode pairs move KV: sglang "
                                 "(bootstrap fields) or vllm (kv_transfer_params, pull mode); "
                                 "records state their own")
        parser.add_argument("--worker-urls", nargs="+", action="extend", default=[],
                            metavar="URL", help="static aggregated workers (sglang-router's "
                                                "regular mode): each serves whole requests")
        parser.add_argument("--pd-disaggregation", action="store_true",
                            help="accepted for sglang-router compatibility (PD pools are "
                                 "those of --prefill/--decode and of prefill/decode records)")
        parser.add_argument("--admin-token", default=None,
                            help=f"token for POST/DELETE /workers (default: ${ADMIN_TOKEN_ENV}, "
                                 "which keeps it out of ps; neither: admin disabled)")
        parser.add_argument("--forward-client-auth", action="store_true",
                            help="forward the client's Authorization and Cookie headers to the "
                                 "workers (default: not forwarded)")
        parser.add_argument("--max-body", "--max-payload-size", type=int, dest="max_body",
                            default=d.max_body,
                            help=f"bytes (413 above; default {d.max_body}, the engine's)")
        parser.add_argument("--max-prompt-tokens", type=int, default=None,
                            help="longest prompt in tokens (400 above; default: the limits the "
                                 "workers state in /server_info or their etcd record)")
        add_kv_aware_args(parser)
        add_resilience_args(parser)
        parser.add_argument("--client-read-timeout-secs", type=float,
                            default=d.client_read_timeout,
                            help="seconds a client has to send a whole request (408 after)")
        parser.add_argument("--request-id-headers", nargs="+", default=None, metavar="NAME",
                            help="headers to read a client's request id from, in order "
                                 "(default x-request-id)")
        parser.add_argument("--max-concurrent-requests", type=int,
                            default=d.max_concurrent_requests,
                            help="proxied requests at once, the rest queue (-1: no limit)")
        parser.add_argument("--queue-size", type=int, default=d.queue_size,
                            help="requests waiting for a slot (429 past it)")
        parser.add_argument("--queue-timeout-secs", type=float, dest="queue_timeout",
                            default=d.queue_timeout, help="wait for a slot (408 after)")
        parser.add_argument("--no-worker-admission", action="store_true",
                            help="forward at once, whatever a worker states it holds")
        parser.add_argument("--worker-queue-size", type=int, default=d.worker_queue_size,
                            help="requests waiting for a worker with room (429 past it)")
        parser.add_argument("--worker-queue-timeout-secs", type=float,
                            dest="worker_queue_timeout", default=d.worker_queue_timeout,
                            help="wait for a worker with room (408 after)")
        parser.add_argument("--shutdown-grace-period-secs", type=float, dest="shutdown_grace",
                            default=d.shutdown_grace,
                            help="seconds in-flight requests may finish when stopping")
        parser.add_argument("--prometheus-port", type=int, default=None,
                            help="also serve /metrics on this port (default: main port only)")
        parser.add_argument("--prometheus-host", default=d.prometheus_host,
                            help=f"address of the --prometheus-port listener "
                                 f"(default {d.prometheus_host})")
        parser.add_argument("--no-uvloop", action="store_true",
                            help="use the asyncio event loop even when uvloop is installed")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace,
                      access: ClusterAccess | None = None) -> RouterConfig:
        """Build from parsed flags; ``access``: the cluster the CLI's etcd flags name (None:
        static workers only)."""
        access = access or ClusterAccess()
        prefill: list[tuple[str, int | None]] = []
        for item in args.prefill:
            if len(item) > 2:
                raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {item}")
            prefill.append((item[0], item[1] if len(item) == 2 else None))
        return cls(
            host=args.host, port=args.port, etcd=access.etcd, index_etcd=access.index_shards,
            etcd_prefix=access.prefix, model=args.model,
            tokenizers=parse_tokenizer_flags(args.tokenizer),
            prefill=prefill, decode=list(args.decode), pd_protocol=args.pd_protocol,
            worker_urls=list(args.worker_urls),
            admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
            forward_client_auth=args.forward_client_auth,
            max_body=args.max_body, max_prompt_tokens=args.max_prompt_tokens,
            **routing_kwargs(args), **resilience_kwargs(args),
            client_read_timeout=args.client_read_timeout_secs,
            prometheus_port=args.prometheus_port, prometheus_host=args.prometheus_host,
            shutdown_grace=args.shutdown_grace,
            request_id_headers=tuple(args.request_id_headers or ("x-request-id",)),
            max_concurrent_requests=args.max_concurrent_requests, queue_size=args.queue_size,
            queue_timeout=args.queue_timeout,
            worker_admission=not args.no_worker_admission,
            worker_queue_size=args.worker_queue_size,
            worker_queue_timeout=args.worker_queue_timeout,
            uvloop=not args.no_uvloop,
        )
