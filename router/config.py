"""The router's one config dataclass, with flags that mirror sglang-router's PD mode."""
from __future__ import annotations

import argparse
import os
import re
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_instance_id, validate_model
from index.shards import IndexShards
from index.tiers import TierWeights
from router.engine_load import check_thresholds
from router.kv_flags import add_kv_aware_args, kv_aware_kwargs
from tokenization import BYTE, TokenizerError, can_load, canonical_model
from tokenization.assets import KNOWN_NAMES, is_known

ADMIN_TOKEN_ENV = "KVATLAS_ADMIN_TOKEN"
"""Where ``--admin-token`` is read from when not given."""

POLICIES = ("kv_aware", "round_robin", "random", "power_of_two")
POLICY_ALIASES = {"cache_aware": "kv_aware"}
"""sglang-router's names, accepted so that its command lines work unchanged: its cache_aware
(an approximate per-router text tree) maps to kv_aware (the global block index)."""
MAX_PORT = 65535


def default_router_id() -> str:
    """``host-pid-random``, an instance id that differs for every router process."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "router"
    if not host[0].isalnum():
        host = "r" + host
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


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
class RouterConfig:
    """Everything a router process needs; the CLI only parses flags into this."""

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
    policy: str = "kv_aware"
    """Default policy for both sides (decode falls back to power_of_two for kv_aware)."""
    prefill_policy: str | None = None
    """Prefill policy; None: ``policy``."""
    decode_policy: str | None = None
    """Decode policy; None: ``policy``, or power_of_two when that is kv_aware."""
    prefill: list[tuple[str, int | None]] = field(default_factory=list)
    """Static prefill workers: (URL, bootstrap port or None for the prefill's default 8998)."""
    decode: list[str] = field(default_factory=list)
    """Static decode worker URLs."""
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
    block_size: int = 16
    """Tokens per KV block; must equal the engines' page size so hashes match."""
    overlap_weight: float = 2.0
    """kv_aware: cost per prefill block left to compute; the load term counts 1 per block of
    prefill work. Above 1 because a hit also spares a duplicate copy of the prefix in another
    cache (bench/routing_quality.py, concurrency 6: 1.0 served ~6% fewer cached tokens than the
    old request-count load, 2.0 is within run-to-run noise of it)."""
    send_weight: float = 0.05
    """kv_aware: work of sending one block's KV to the decode, in blocks of prefill compute. A
    prefill sends every block of a prompt, cached or not, so a burst of fully cached requests
    still queues at their holder: this term is what makes one spread (``--send-weight``).
    bench/routing_quality.py: 0.25 spread a reuse trace enough to cost ~9% of its cached
    tokens; 0.05 cost none measurable and still spreads a 256-request burst (max/mean 1.25)."""
    tier_weights: TierWeights = field(default_factory=TierWeights)
    """kv_aware: what a matched block is worth by the cache tier holding it (device 1.0, host
    0.75, disk 0.25): a host or disk hit is copied to the device, not reused in place."""
    temperature: float = 0.0
    """0: lowest cost wins; > 0: softmax sampling over -cost / temperature."""
    load_interval: float = 1.0
    """Seconds between reads of every worker's ``/metrics`` (its own queue, running requests,
    KV usage: router/engine_load.py); 0 turns scraping off."""
    busy_queue: int | None = None
    """A worker whose engine reports this many queued requests is not chosen while another is
    not busy (None: off). ``PUT /admin/thresholds`` changes it at run time."""
    busy_kv_usage: float | None = None
    """The same for the engine's KV-cache usage, a fraction in (0, 1] (None: off)."""
    explain_routes: bool = False
    """Every answer carries ``X-Kvatlas-Route`` (the decision and its cost terms); otherwise
    only answers to requests sending ``X-Kvatlas-Explain: 1``."""
    prediction_ttl: float = 120.0
    """Seconds a routed prompt's blocks count as held by the chosen prefill before events arrive."""
    prediction_catch_up: float = 5.0
    """Seconds a prediction on an instance whose events the index shows may bridge the index's
    lag; it is dropped sooner once the index shows that prompt stored there. Instances the index
    has never shown keep their predictions for ``prediction_ttl``."""
    work_half_life: float = 2.0
    """Half-life in seconds of finished prefill work in the kv_aware load term (0: count only
    in-flight work). Spreads new conversations at low concurrency."""
    share_predictions: bool = True
    """kv_aware with etcd: publish this router's predictions and follow the other routers'
    (router/shared_predictions.py), so that a conversation whose turns reach different routers
    finds its holder before the engines' KV events do. Costs one etcd put per
    ``share_window`` in which this router routed a prompt the index did not fully show."""
    share_window: float = 0.01
    """Seconds of predictions gathered into one etcd put."""
    router_id: str | None = None
    """This router's name among the routers sharing predictions (None: host-pid-random)."""
    prediction_max_blocks: int = 1_000_000
    """Bound on predicted (instance, block) entries; the oldest go first past it."""
    canary_delay: float = 2.0
    """Seconds after a prefill served a prompt before the router asks its block index whether
    that prefill holds the prompt's first block (a canary: router/canary.py). Long enough for
    the engine's KV events to reach etcd and the router's mirror."""
    canary_interval: float = 1.0
    """Seconds between two canaries taken for one prefill instance (0: one per served request,
    still at most 4 waiting per instance)."""
    health_interval: float = 5.0
    """Seconds between health checks of each worker."""
    health_check_enabled: bool = True
    """False: no health checks; workers count as healthy while registered."""
    health_timeout: float = 5.0
    """Seconds a health check may take."""
    health_failure_threshold: int = 3
    """Consecutive failed checks that mark a worker unhealthy."""
    health_success_threshold: int = 2
    """Consecutive passed checks that mark it healthy again."""
    breaker_failure_threshold: int = 10
    """Consecutive failures that open a worker's circuit."""
    breaker_success_threshold: int = 3
    """Successes in half-open that close it."""
    breaker_timeout: float = 60.0
    """Seconds an open circuit waits before going half-open."""
    breaker_enabled: bool = True
    """False: circuits never open (a failed attempt is still retried on another pair)."""
    retry_max_attempts: int = 5
    """Attempts in all (1: no retries)."""
    retry_initial_backoff: float = 0.05
    """Seconds before the second attempt."""
    retry_backoff_multiplier: float = 1.5
    """Backoff growth per attempt."""
    retry_max_backoff: float = 30.0
    """Cap on one backoff."""
    retry_jitter: float = 0.2
    """Relative jitter (±) on each backoff."""
    request_timeout: float = 1800.0
    """Seconds an upstream may stay silent (between bytes) before the attempt fails."""
    client_read_timeout: float = 60.0
    """Seconds a client has to send a whole request once its first byte arrived (408 after):
    a client trickling bytes cannot hold a connection forever."""
    connect_timeout: float = 10.0
    """Seconds to connect to an upstream."""
    max_connections: int = 2048
    """Upstream connection pool size."""
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

    def __post_init__(self) -> None:
        if not 0 <= self.port <= MAX_PORT:
            raise ValueError(f"port must be within [0, {MAX_PORT}], got {self.port}")
        if self.prometheus_port is not None and not 0 <= self.prometheus_port <= MAX_PORT:
            raise ValueError(f"prometheus port must be within [0, {MAX_PORT}], got "
                             f"{self.prometheus_port}")
        KeyLayout(prefix=self.etcd_prefix)
        if self.index_etcd.sharded and self.etcd is None:
            raise ValueError("--index-etcd needs --etcd (workers are discovered there)")
        if self.model is not None:
            self.model = canonical_model(self.model)
            validate_model(self.model)
        self.tokenizers = {None if m is None else canonical_model(m): check_tokenizer_source(s)
                           for m, s in self.tokenizers.items()}
        for name in ("policy", "prefill_policy", "decode_policy"):
            value = POLICY_ALIASES.get(getattr(self, name), getattr(self, name))
            setattr(self, name, value)
            if value is not None and value not in POLICIES:
                raise ValueError(f"{name} {value!r} is unknown: use one of {', '.join(POLICIES)}")
        self.prefill = [(check_url(u), parse_bootstrap_port(p)) for u, p in self.prefill]
        self.decode = [check_url(u) for u in self.decode]
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin token must be at least 8 characters")
        positive = ("max_body", "max_tokens", "block_size", "prediction_max_blocks",
                    "health_failure_threshold", "health_success_threshold",
                    "breaker_failure_threshold", "breaker_success_threshold",
                    "retry_max_attempts", "max_connections")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval", "health_timeout", "request_timeout", "connect_timeout",
                     "client_read_timeout",
                     "prediction_ttl", "retry_backoff_multiplier", "worker_queue_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        check_thresholds(self.busy_queue, self.busy_kv_usage)
        if not 0.001 <= self.share_window <= 1.0:
            raise ValueError(f"share_window must be within [0.001, 1] s, got {self.share_window}")
        if self.router_id is None:
            self.router_id = default_router_id()
        validate_instance_id(self.router_id)
        for name in ("overlap_weight", "temperature", "prediction_catch_up", "work_half_life",
                     "load_interval", "send_weight",
                     "canary_delay", "canary_interval",
                     "shutdown_grace", "queue_size", "queue_timeout", "worker_queue_size",
                     "breaker_timeout", "retry_initial_backoff",
                     "retry_max_backoff"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.request_id_headers = tuple(h.strip().lower() for h in self.request_id_headers)
        if not self.request_id_headers or not all(self.request_id_headers):
            raise ValueError("request_id_headers needs at least one non-empty header name")
        if not 0 <= self.retry_jitter < 1:
            raise ValueError(f"retry_jitter must be within [0, 1), got {self.retry_jitter}")

    @property
    def layout(self) -> KeyLayout:
        return KeyLayout(prefix=self.etcd_prefix)

    @property
    def effective_prefill_policy(self) -> str:
        return self.prefill_policy or self.policy

    @property
    def effective_decode_policy(self) -> str:
        if self.decode_policy:
            return self.decode_policy
        return "power_of_two" if self.policy == "kv_aware" else self.policy

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1`` (no jitter)."""
        return min(self.retry_max_backoff,
                   self.retry_initial_backoff * self.retry_backoff_multiplier ** attempt)

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
        choices = [*POLICIES, *POLICY_ALIASES]
        parser.add_argument("--policy", default=d.policy, choices=choices,
                            help="policy for both sides (default kv_aware; decode uses "
                                 "power_of_two then; cache_aware means kv_aware)")
        parser.add_argument("--prefill-policy", default=None, choices=choices)
        parser.add_argument("--decode-policy", default=None, choices=choices)
        parser.add_argument("--prefill", nargs="+", action="append", default=[],
                            metavar="URL [BOOTSTRAP_PORT|none]",
                            help="static prefill worker, repeatable")
        parser.add_argument("--decode", action="append", default=[], metavar="URL",
                            help="static decode worker, repeatable")
        parser.add_argument("--pd-disaggregation", action="store_true",
                            help="accepted for sglang-router compatibility (always PD)")
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
        parser.add_argument("--block-size", type=int, default=d.block_size,
                            help="tokens per KV block (the engines' page size)")
        add_kv_aware_args(parser, d)
        parser.add_argument("--explain-routes", action="store_true",
                            help="add X-Kvatlas-Route (the decision, its cost terms) to every "
                                 "answer (default: only when the request sends "
                                 "X-Kvatlas-Explain: 1)")
        parser.add_argument("--canary-delay", type=float, default=d.canary_delay,
                            help="seconds after a served prompt before the router checks that "
                                 "the index shows it on its prefill (default 2)")
        parser.add_argument("--canary-interval", type=float, default=d.canary_interval,
                            help="seconds between two canaries of one prefill (default 1)")
        parser.add_argument("--health-check-interval-secs", "--health-interval", type=float,
                            dest="health_interval", default=d.health_interval)
        parser.add_argument("--health-check-timeout-secs", type=float, dest="health_timeout",
                            default=d.health_timeout)
        parser.add_argument("--cb-failure-threshold", type=int,
                            default=d.breaker_failure_threshold)
        parser.add_argument("--cb-success-threshold", type=int,
                            default=d.breaker_success_threshold)
        parser.add_argument("--cb-timeout-duration-secs", type=float, default=d.breaker_timeout)
        parser.add_argument("--disable-circuit-breaker", action="store_true",
                            help="circuits never open")
        parser.add_argument("--disable-health-check", action="store_true",
                            help="no health checks: registered workers count as healthy")
        parser.add_argument("--retry-max-retries", type=int, default=d.retry_max_attempts,
                            help="attempts in all (default 5)")
        parser.add_argument("--retry-initial-backoff-ms", type=float,
                            default=d.retry_initial_backoff * 1000)
        parser.add_argument("--retry-max-backoff-ms", type=float,
                            default=d.retry_max_backoff * 1000)
        parser.add_argument("--retry-backoff-multiplier", type=float,
                            default=d.retry_backoff_multiplier)
        parser.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter)
        parser.add_argument("--disable-retries", action="store_true",
                            help="one attempt per request (as --retry-max-retries 1)")
        parser.add_argument("--health-failure-threshold", type=int,
                            default=d.health_failure_threshold)
        parser.add_argument("--health-success-threshold", type=int,
                            default=d.health_success_threshold)
        parser.add_argument("--request-timeout-secs", type=float, default=d.request_timeout)
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
                      etcd: EtcdSettings | None = None) -> RouterConfig:
        prefill: list[tuple[str, int | None]] = []
        for item in args.prefill:
            if len(item) > 2:
                raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT|none], got {item}")
            prefill.append((item[0], item[1] if len(item) == 2 else None))
        return cls(
            host=args.host, port=args.port, etcd=etcd,
            index_etcd=IndexShards.from_cli_args(args, etcd or EtcdSettings()),
            etcd_prefix=getattr(args, "etcd_prefix", DEFAULT_PREFIX), model=args.model,
            tokenizers=parse_tokenizer_flags(getattr(args, "tokenizer", None) or []),
            policy=args.policy, prefill_policy=args.prefill_policy,
            decode_policy=args.decode_policy, prefill=prefill, decode=list(args.decode),
            admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
            forward_client_auth=getattr(args, "forward_client_auth", False),
            max_body=args.max_body, max_prompt_tokens=args.max_prompt_tokens,
            block_size=args.block_size,
            explain_routes=args.explain_routes, **kv_aware_kwargs(args),
            canary_delay=args.canary_delay, canary_interval=args.canary_interval,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            breaker_failure_threshold=args.cb_failure_threshold,
            breaker_success_threshold=args.cb_success_threshold,
            breaker_timeout=args.cb_timeout_duration_secs,
            breaker_enabled=not args.disable_circuit_breaker,
            health_check_enabled=not args.disable_health_check,
            retry_max_attempts=1 if args.disable_retries else args.retry_max_retries,
            retry_initial_backoff=args.retry_initial_backoff_ms / 1000,
            retry_max_backoff=args.retry_max_backoff_ms / 1000,
            retry_backoff_multiplier=args.retry_backoff_multiplier,
            retry_jitter=args.retry_jitter_factor,
            health_failure_threshold=args.health_failure_threshold,
            health_success_threshold=args.health_success_threshold,
            request_timeout=args.request_timeout_secs,
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
