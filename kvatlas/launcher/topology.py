"""One description of a kvatlas cluster, rendered as local processes or as compose services.

``Topology`` says what runs (etcd members, prefill and decode instances, the router) and how
they are configured; a ``Network`` says where each part listens and how the others reach it.
``Topology.services(network)`` is the single place that writes each process's command line, so
``kvatlas cluster up`` (``LocalNetwork``: loopback, free ports) and ``docker-compose.yml``
(``ComposeNetwork``: service names, fixed ports) cannot drift: tests compare the two.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol

from bootstrap.config import AUTH_TOKEN_ENV
from index.access import DEFAULT_LEASE_TTL, ETCD_PASSWORD_ENV, check_lease_ttl
from index.keys import DEFAULT_PREFIX, KeyLayout, validate_model
from index.pd_protocol import SGLANG_BOOTSTRAP, PDProtocol
from kvatlas.etcd_proc import COMPACTION_ARGS, free_port
from kvatlas.launcher.etcd_auth import EtcdAuth
from router.config import ADMIN_TOKEN_ENV
from tokenization import canonical_model
from transfer.base import TRANSFER_KEY_ENV

ROLES = ("etcd", "prefill", "decode", "aggregated", "router", "sidecar")
"""``sidecar``: a ``kvatlas sidecar`` beside an engine that is not ours (SGLang), publishing its
record, bootstrap table and KV events to etcd (``kvatlas/launcher/compose_sglang.py``).
``aggregated``: a monolithic engine registered in etcd (role aggregated: whole requests)."""
ENGINE_ROLES = ("prefill", "decode", "aggregated")
"""The roles of engine instances (started after etcd, before the router)."""
ENGINE_KINDS = ("kvatlas", "sglang")
"""What the prefill and decode instances run: kvatlas's own engine (``kvatlas engine serve``),
or SGLang with a sidecar each (compose only: the local launcher runs no GPU engines)."""
DEFAULT_MODEL = "smollm2-135m"
"""The model a cluster serves unless told otherwise (``--model``): a real instruct model whose
answers are sentences, small enough (135M parameters) for a few CPU processes on a laptop."""
ENGINE_MODES = ("pd", "monolithic")

# Flags whose values are addresses (differ between networks) or secrets (differ per cluster).
ADDRESS_FLAGS = frozenset({"--host", "--port", "--bootstrap-port", "--etcd", "--advertise-host",
                           "--decode", "--prefill"})
SECRET_ENV = {"--auth-token": AUTH_TOKEN_ENV, "--admin-token": ADMIN_TOKEN_ENV,
              "--etcd-password": ETCD_PASSWORD_ENV}
"""Secret flags and the environment variables each process reads them from instead."""
SECRET_FLAGS = frozenset(SECRET_ENV)


def instance_counts(prefill: int | None, decode: int | None, aggregated: int
                    ) -> tuple[int, int]:
    """(prefill, decode) instances from flags that may be absent (None): with aggregated
    instances and neither given, none (aggregated alone); otherwise 2 and 1 by default."""
    if aggregated and prefill is None and decode is None:
        return 0, 0
    return (2 if prefill is None else prefill), (1 if decode is None else decode)


def process_args(svc: Service) -> tuple[list[str], dict[str, str]]:
    """(``svc``'s arguments without secret flags, every secret it needs as environment
    variables): the secret flags' values, and the secrets that have no flag (``svc.env``)."""
    argv, env = split_secrets(svc.args)
    return argv, {**env, **svc.env}


def split_secrets(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(``args`` without secret flags, those secrets as environment variables): a process's
    command line is readable by every user of the host (``ps``), its environment is not."""
    argv: list[str] = []
    env: dict[str, str] = {}
    it = iter(args)
    for a in it:
        if a in SECRET_ENV:
            env[SECRET_ENV[a]] = next(it)
        else:
            argv.append(a)
    return argv, env


class Network(Protocol):
    """Where services listen and how their peers dial them."""

    listen_host: str
    data_root: str

    def host(self, service: str) -> str:
        """The host name peers use to reach ``service``."""

    def port(self, service: str, purpose: str) -> int:
        """The port ``service`` uses for ``purpose`` (``http``, ``bootstrap``, ``peer``)."""


@dataclass
class LocalNetwork:
    """Every service on one host: free loopback ports unless pinned in ``fixed``."""

    listen_host: str = "127.0.0.1"
    data_root: str = "/tmp/kvatlas-etcd"
    """Directory holding each etcd member's data directory."""
    fixed: dict[tuple[str, str], int] = field(default_factory=dict)
    """Pinned ports by (service, purpose); everything else gets a free port once, then keeps it."""

    def host(self, service: str) -> str:
        return self.listen_host

    def port(self, service: str, purpose: str) -> int:
        key = (service, purpose)
        if key not in self.fixed:
            # A probed port is free only until someone binds it, and nothing here is bound
            # before every port is picked: the kernel may hand one out twice (a router once
            # got a prefill's port, and its health check answered from the prefill).
            taken = set(self.fixed.values())
            port = free_port(self.listen_host)
            while port in taken:
                port = free_port(self.listen_host)
            self.fixed[key] = port
        return self.fixed[key]


@dataclass
class ComposeNetwork:
    """One container per service: listen on all interfaces, peers dial the service name."""

    listen_host: str = "0.0.0.0"
    data_root: str = "/var/lib/etcd"
    ports: dict[str, int] = field(default_factory=lambda: {
        "http": 30000, "bootstrap": 8998, "client": 2379, "peer": 2380, "router": 8000,
        # A sidecar's KV-event socket (ZMQ SUB, bound); attention-DP rank r uses this + r.
        "kv_events": 5557})

    def host(self, service: str) -> str:
        return service

    def port(self, service: str, purpose: str) -> int:
        return self.ports[purpose]


@dataclass
class EtcdClientFlags:
    """The etcd client's TLS and auth options, passed through to every process that dials etcd."""

    prefix: str = DEFAULT_PREFIX
    user: str | None = None
    password: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def args(self) -> list[str]:
        out = ["--etcd-prefix", self.prefix] if self.prefix != DEFAULT_PREFIX else []
        for flag, value in (("--etcd-user", self.user), ("--etcd-password", self.password),
                            ("--etcd-ca", self.ca), ("--etcd-cert", self.cert),
                            ("--etcd-key", self.key)):
            if value is not None:
                out += [flag, value]
        return out


@dataclass
class Service:
    """One process of the cluster: its command line and where to check it."""

    name: str
    """Process / compose service name (``etcd0``, ``prefill-0``, ``decode-0``, ``router``)."""
    role: str
    """One of ROLES."""
    args: list[str]
    """Command line after the program: ``kvatlas`` arguments, or etcd's flags for etcd."""
    host: str
    """Host peers dial."""
    port: int
    """Main HTTP port (etcd: the client port)."""
    health_path: str
    """GET path that answers 200 once the process is up (the router: /readiness)."""
    depends_on: list[str] = field(default_factory=list)
    extra_ports: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    """Secrets that have no flag at all, only a variable (the KV transfer key): set in the
    process's environment next to those split off ``args``."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url + self.health_path


@dataclass
class Topology:
    """What a cluster runs; validated on construction."""

    prefill: int = 2
    """Prefill instances."""
    decode: int = 1
    """Decode instances."""
    aggregated: int = 0
    """Aggregated instances: monolithic engines registered in etcd (``--etcd``), which the
    router finds there and sends whole requests; beside the PD pairs, or alone (prefill and
    decode 0)."""
    prefill_tp: int = 1
    """Tensor-parallel ranks per prefill instance."""
    prefill_dp: int = 1
    """Data-parallel ranks per prefill instance."""
    decode_tp: int = 1
    """Tensor-parallel ranks per decode instance."""
    model: str = DEFAULT_MODEL
    """What the engines serve (``kvatlas engine serve --model``): an alias such as the default
    ``smollm2-135m`` (SmolLM2-135M-Instruct, the GGUF the Makefile installs, with its Hugging
    Face tokenizer), a seeded config (``tiny``: the byte tokenizer, what tests run) or a
    checkpoint name. The router serves its canonical name (``tokenization.canonical_model``)."""
    etcd_members: int = 1
    """Embedded etcd members (1 or 3); ignored when ``external_etcd`` is set."""
    external_etcd: str | None = None
    """``HOST:PORT[,...]`` of an etcd the cluster uses instead of starting its own."""
    etcd_client: EtcdClientFlags = field(default_factory=EtcdClientFlags)
    """TLS/auth/prefix options for every etcd client."""
    index_shards: int = 0
    """Embedded etcds of one member each the block index is spread over (``--index-etcd`` of
    the prefills and the router); 0: the blocks live in the main etcd."""
    auth_token: str | None = None
    """Bootstrap write token (``--auth-token`` of prefill instances); None: generated."""
    admin_token: str | None = None
    """Router admin token (``--admin-token``); None: generated."""
    transfer_key: str | None = None
    """KV transfer MAC key of every prefill and decode rank (``KVATLAS_TRANSFER_KEY``, never a
    flag); None: generated."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """Instance lease TTL in seconds."""
    health_interval: float = 2.0
    """Router health-check interval in seconds."""
    engine_mode: str = "pd"
    """``pd``: prefill and decode engine modes; ``monolithic``: monolithic engines stand in for
    both roles (the router lists them statically; no KV transfer)."""
    pd_protocol: str = "sglang"
    """How the router tells a prefill/decode pair to move KV (``index.pd_protocol``:
    ``sglang``, ``vllm``/``vllm-pull`` or ``vllm-push``): each prefill and decode engine serves
    it (``--pd-protocol``) and says so in its record, whence the router drives the pair."""
    etcd_auth: EtcdAuth | None = None
    """Credentials of the embedded etcds (``kvatlas.launcher.etcd_auth``): each process dials
    them as the user of its kind. None with embedded etcd: generated; an external etcd keeps
    ``etcd_client``'s user instead."""

    def __post_init__(self) -> None:
        validate_model(self.model)
        validate_model(self.served_model)
        KeyLayout(prefix=self.etcd_client.prefix)
        for name in ("prefill_tp", "prefill_dp", "decode_tp"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be within [1, 64], got {getattr(self, name)}")
        for name in ("prefill", "decode", "aggregated"):
            if not 0 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be within [0, 64], got {getattr(self, name)}")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError(f"prefill and decode instances come in pairs: {self.prefill} "
                             f"prefill and {self.decode} decode; give both, or neither with "
                             "aggregated instances")
        if self.prefill == 0 and self.aggregated == 0:
            raise ValueError("no engine instances: give prefill and decode instances, or "
                             "aggregated ones")
        if not 0 <= self.index_shards <= 16:
            raise ValueError(f"index shards must be within [0, 16], got {self.index_shards}")
        if self.external_etcd is None and self.etcd_members not in (1, 3):
            raise ValueError(f"etcd members must be 1 or 3, got {self.etcd_members}")
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {self.engine_mode!r}")
        if self.engine_mode == "monolithic" and self.aggregated:
            raise ValueError("engine mode monolithic (unregistered stand-ins for prefill and "
                             "decode) and aggregated instances exclude each other: for "
                             "monolithic engines in etcd give aggregated instances alone")
        protocol = PDProtocol.parse(self.pd_protocol)
        if protocol != SGLANG_BOOTSTRAP and (self.engine_mode != "pd" or not self.prefill):
            raise ValueError(f"--pd-protocol {self.pd_protocol} is the protocol of prefill and "
                             "decode engines; this cluster has none (engine mode "
                             f"{self.engine_mode}, {self.prefill} prefill): drop it, or use "
                             "--engine-mode pd with prefill and decode instances")
        check_lease_ttl(self.lease_ttl)
        # Hex: a token must never start with "-", or argparse would read it as a flag.
        if self.auth_token is None:
            self.auth_token = secrets.token_hex(24)
        if self.admin_token is None:
            self.admin_token = secrets.token_hex(24)
        if self.transfer_key is None:
            self.transfer_key = secrets.token_hex(32)
        if self.external_etcd is not None:
            if self.etcd_auth is not None:
                raise ValueError("etcd auth is provisioned on embedded etcd only; an external "
                                 "etcd takes --etcd-user and $KVATLAS_ETCD_PASSWORD")
        elif self.etcd_client.user is not None:
            raise ValueError("--etcd-user applies to an external etcd (--etcd HOST:PORT); the "
                             "embedded etcd gets generated users (kept in the run dir)")
        elif self.etcd_auth is None:
            self.etcd_auth = EtcdAuth.generate()

    @property
    def served_model(self) -> str:
        """The model name clients, the router and the instance records use (an alias's
        canonical name, e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``)."""
        return canonical_model(self.model)

    def router_tokenizer(self) -> str | None:
        """The router's ``--tokenizer``: the alias itself when the model is one (the router
        loads the same bundled tokenizer the engines do, before the first request); else None,
        and the router takes the tokenizer the instance records name."""
        return self.model if self.served_model != self.model else None

    # --- names -----------------------------------------------------------------------------

    def etcd_names(self) -> list[str]:
        return [] if self.external_etcd else [f"etcd{i}" for i in range(self.etcd_members)]

    def index_etcd_names(self) -> list[str]:
        return [f"etcd-index{i}" for i in range(self.index_shards)]

    def index_etcd_endpoints(self, net: Network) -> list[str]:
        """One ``HOST:PORT`` per index shard (``--index-etcd``'s values)."""
        return [f"{net.host(n)}:{net.port(n, 'client')}" for n in self.index_etcd_names()]

    def prefill_names(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.prefill)]

    def decode_names(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.decode)]

    def aggregated_names(self) -> list[str]:
        return [f"aggregated-{i}" for i in range(self.aggregated)]

    def etcd_endpoints(self, net: Network) -> str:
        if self.external_etcd:
            return self.external_etcd
        return ",".join(f"{net.host(n)}:{net.port(n, 'client')}" for n in self.etcd_names())

    # --- services --------------------------------------------------------------------------

    def services(self, net: Network) -> list[Service]:
        """Every process in start order: etcd, prefills, decodes, aggregated, router."""
        out = [self._etcd(net, n, self.etcd_names()) for n in self.etcd_names()]
        out += [self._etcd(net, n, [n]) for n in self.index_etcd_names()]
        out += [self._prefill(net, n) for n in self.prefill_names()]
        out += [self._decode(net, n) for n in self.decode_names()]
        out += [self._aggregated(net, n) for n in self.aggregated_names()]
        out.append(self._router(net, out))
        return out

    def _etcd(self, net: Network, name: str, members: list[str]) -> Service:
        peers = ",".join(f"{n}=http://{net.host(n)}:{net.port(n, 'peer')}" for n in members)
        client, peer = net.port(name, "client"), net.port(name, "peer")
        listen = net.listen_host
        args = [
            f"--name={name}",
            f"--data-dir={net.data_root}/{name}.etcd",
            f"--listen-client-urls=http://{listen}:{client}",
            f"--advertise-client-urls=http://{net.host(name)}:{client}",
            f"--listen-peer-urls=http://{listen}:{peer}",
            f"--initial-advertise-peer-urls=http://{net.host(name)}:{peer}",
            f"--initial-cluster={peers}",
            "--initial-cluster-token=kvatlas",
            "--initial-cluster-state=new",
            "--log-level=warn",
            *COMPACTION_ARGS,
        ]
        return Service(name, "etcd", args, net.host(name), client, "/health",
                       extra_ports={"peer": peer})

    def _etcd_args(self, net: Network, kind: str, index: bool = False) -> list[str]:
        """The etcd flags of a ``kind`` process (its etcd user, ``etcd_auth.WRITES``);
        ``index``: also the index shards (a writer or reader of blocks)."""
        shards = self.index_etcd_endpoints(net) if index else []
        user: list[str] = []
        if self.etcd_auth is not None:
            name, password = self.etcd_auth.credentials(kind)
            user = ["--etcd-user", name, "--etcd-password", password]
        return ["--etcd", self.etcd_endpoints(net), *self.etcd_client.args(), *user,
                *(["--index-etcd", *shards] if shards else [])]

    def _common_engine(self, net: Network, name: str) -> list[str]:
        return ["engine", "serve", "--model", self.model, "--host", net.listen_host,
                "--port", str(net.port(name, "http"))]

    def _pd_flags(self, net: Network, name: str) -> list[str]:
        """Prefill and decode alike: the host peers dial (etcd url, bootstrap host, rank_ip)
        and the bootstrap write token (required by prefills, sent by decodes); the PD protocol
        when not SGLang's bootstrap (the engines' default, so SGLang clusters' lines stay)."""
        protocol = [] if self.pd_protocol == "sglang" else ["--pd-protocol", self.pd_protocol]
        return ["--advertise-host", net.host(name), "--auth-token", str(self.auth_token),
                *protocol]

    def _prefill(self, net: Network, name: str) -> Service:
        port = net.port(name, "http")
        extra: dict[str, int] = {}
        if self.engine_mode == "monolithic":
            args = [*self._common_engine(net, name), "--mode", "monolithic"]
        else:
            boot = net.port(name, "bootstrap")
            extra["bootstrap"] = boot
            args = [*self._common_engine(net, name), "--mode", "prefill",
                    "--tp", str(self.prefill_tp), "--dp", str(self.prefill_dp),
                    "--bootstrap-port", str(boot), "--instance-id", name,
                    "--lease-ttl", str(self.lease_ttl), *self._pd_flags(net, name),
                    *self._etcd_args(net, "prefill", index=True)]
        return Service(name, "prefill", args, net.host(name), port, "/health",
                       depends_on=self.etcd_names() + self.index_etcd_names(),
                       extra_ports=extra, env=self._pd_env())

    def _decode(self, net: Network, name: str) -> Service:
        port = net.port(name, "http")
        if self.engine_mode == "monolithic":
            args = [*self._common_engine(net, name), "--mode", "monolithic"]
        else:
            args = [*self._common_engine(net, name), "--mode", "decode",
                    "--tp", str(self.decode_tp), "--instance-id", name,
                    "--lease-ttl", str(self.lease_ttl), *self._pd_flags(net, name),
                    *self._etcd_args(net, "decode")]
        return Service(name, "decode", args, net.host(name), port, "/health",
                       depends_on=self.etcd_names(), env=self._pd_env())

    def _aggregated(self, net: Network, name: str) -> Service:
        """A monolithic engine that registers itself (record and blocks) in etcd."""
        args = [*self._common_engine(net, name), "--mode", "monolithic", "--instance-id", name,
                "--lease-ttl", str(self.lease_ttl), "--advertise-host", net.host(name),
                # the prefill's etcd user: it writes a superset (record, blocks) of what an
                # aggregated instance writes, and a kind of its own would change every
                # deployment's provisioned users
                *self._etcd_args(net, "prefill", index=True)]
        return Service(name, "aggregated", args, net.host(name), net.port(name, "http"),
                       "/health", depends_on=self.etcd_names() + self.index_etcd_names())

    def _pd_env(self) -> dict[str, str]:
        """Prefill and decode ranks MAC their KV transfer messages with one shared key
        (monolithic stand-ins transfer nothing)."""
        return {TRANSFER_KEY_ENV: str(self.transfer_key)} if self.engine_mode == "pd" else {}

    def _router(self, net: Network, others: list[Service]) -> Service:
        name = "router"
        port = net.port(name, "router")
        args = ["router", "serve", "--host", net.listen_host, "--port", str(port),
                "--model", self.served_model, "--admin-token", str(self.admin_token),
                "--health-check-interval-secs", f"{self.health_interval:g}",
                *self._etcd_args(net, "router", index=True)]
        tokenizer = self.router_tokenizer()
        if tokenizer is not None:
            args += ["--tokenizer", tokenizer]
        if self.engine_mode == "monolithic":
            # Monolithic stand-ins do not register in etcd: list them statically.
            for s in others:
                if s.role == "prefill":
                    args += ["--prefill", s.url, "none"]
                elif s.role == "decode":
                    args += ["--decode", s.url]
        deps = [s.name for s in others if s.role in ENGINE_ROLES]
        return Service(name, "router", args, net.host(name), port, "/readiness",
                       depends_on=deps)


def normalized(args: list[str]) -> list[str]:
    """``args`` with address and secret values replaced by placeholders (for parity checks)."""
    out: list[str] = []
    skip = 0
    for a in args:
        if skip:
            skip -= 1
            continue
        if a in ADDRESS_FLAGS or a in SECRET_FLAGS:
            out += [a, "<secret>" if a in SECRET_FLAGS else "<addr>"]
            skip = 1
        else:
            out.append(a)
    return out
