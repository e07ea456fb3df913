"""Configuration of a prefill or decode instance (``kvatlas engine serve --mode prefill|decode``):
the engine worker's settings plus ranks, bootstrap, transfer and etcd."""
from __future__ import annotations

import argparse
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from bootstrap.config import AUTH_TOKEN_ENV, DEFAULT_PORT
from engine.registration import check_advertise_host, public_host
from engine.serve_config import EngineServerConfig
from index.access import DEFAULT_LEASE_TTL, ClusterAccess
from index.etcd import EtcdSettings
from index.keys import DEFAULT_PREFIX, validate_instance_id
from index.pd_protocol import CHOICES, SGLANG_BOOTSTRAP, PDProtocol
from index.shards import IndexShards
from transfer import BACKENDS, TransferConfig
from transfer.layout import DTYPES

LOAD_BALANCE = ("follow_bootstrap_room", "round_robin")
"""Environment variable read when ``--auth-token`` is not given (keeps it out of ``ps``)."""
_ADDR = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")


@dataclass
class PDConfig:
    """One prefill or decode instance; ``engine.mode`` says which."""

    engine: EngineServerConfig
    """Model, KV pool, scheduler and HTTP settings (shared with the monolithic worker)."""
    tp: int = 1
    """Tensor-parallel ranks (one process each); KV heads are split across them."""
    dp: int = 1
    """Data-parallel groups (prefill only); each has its own ranks, pool and prefix cache."""
    instance_id: str | None = None
    """Instance id in etcd and the bootstrap table (default: a generated one)."""
    bootstrap_port: int = DEFAULT_PORT
    """Prefill: the bootstrap server's port (on world rank 0); 0 picks a free one."""
    load_balance_method: str = "follow_bootstrap_room"
    """Prefill DP choice per request: ``follow_bootstrap_room`` (room % dp, as the decode
    computes it) or ``round_robin`` (announced with ``/register_dp_rank``)."""
    kv_cache_dtype: str = "auto"
    """KV pool dtype; ``auto`` is the model dtype. Decode and prefill must agree."""
    transfer_backend: str = "zmq"
    """KV transfer backend (``zmq``; ``cuda_ipc`` on one GPU host)."""
    transfer: TransferConfig = field(default_factory=TransferConfig)
    """Transfer timeouts and the heartbeat (interval, misses)."""
    etcd: EtcdSettings | None = None
    """Register the instance (and, on a prefill, its prefix-cache blocks) in etcd."""
    etcd_prefix: str = DEFAULT_PREFIX
    """etcd key prefix."""
    index_etcd: IndexShards = field(default_factory=IndexShards)
    """The etcd clusters the block index is spread over (``--index-etcd``); none: ``etcd``."""
    lease_ttl: int = DEFAULT_LEASE_TTL
    """TTL of the instance lease."""
    nnodes: int = 1
    """Nodes the instance's ranks span (simulated on one machine by several launches)."""
    node_rank: int = 0
    """This node's index; node 0 runs world rank 0 (HTTP and bootstrap)."""
    dist_init_addr: str | None = None
    """HOST:PORT of torch.distributed's rendezvous (default: a free loopback port, one node)."""
    room_log_keep: int = 4096
    """Decode: finished rooms kept for ``/debug/rooms/{room}``."""
    room_log_ttl_s: float = 600.0
    """Decode: seconds a finished room stays readable."""
    auth_token: str | None = None
    """Bootstrap write token. Prefill: its bootstrap server refuses PUT/POST without
    ``Authorization: Bearer <token>``, and its ranks send it with ``PUT /route`` and
    ``/register_dp_rank``. Decode: sent with POSTs to prefill bootstrap servers
    (``/query_dp_ranks``). None: no auth (only safe on a private network)."""
    advertise_host: str | None = None
    """The host peers dial: the etcd record's ``url``, the bootstrap address and the ranks'
    ``rank_ip``. Default: ``--host``, or this machine's name when ``--host`` is a wildcard."""
    local_prefill: bool = False
    """Decode (``--local-prefill``): serve whole a request that carries ``X-Kvatlas-Prefill:
    local`` and no bootstrap fields (prefill it here, through the monolithic engine's scheduler
    path, with a prefix cache of its own whose blocks are indexed under this decode's lease),
    and say so in the record, so routers may send it short prompts whole. Off by default: a PD
    fleet stays disaggregated for every request unless its operator opts in. Off: such a request
    is a 400, the decode has no prefix cache, and its record says ``local_prefill: false``."""
    pd_protocol: PDProtocol = SGLANG_BOOTSTRAP
    """How routers drive the pair (``--pd-protocol``): SGLang's bootstrap fields (``sglang``, the
    default) or vLLM's ``kv_transfer_params`` (``vllm-pull``, ``vllm`` for short, or
    ``vllm-push``). A prefill in vLLM mode still serves bootstrap requests; a decode serves only
    its own protocol's. Said in the etcd record (``pd_protocol``)."""
    kv_lease_s: float = 30.0
    """vLLM pull prefill: seconds it holds a request's KV pages after answering, waiting for the
    decode to fetch them (vLLM's ``kv_lease_duration``); then they are released."""
    access: ClusterAccess = field(init=False, repr=False, compare=False)
    """``etcd``, ``etcd_prefix``, ``index_etcd`` and ``lease_ttl`` as one checked
    ``ClusterAccess``."""

    def __post_init__(self) -> None:
        if self.engine.mode not in ("prefill", "decode"):
            raise ValueError(f"PDConfig is for --mode prefill or decode, not {self.engine.mode!r}")
        if self.tp < 1 or self.dp < 1 or self.nnodes < 1:
            raise ValueError("--tp, --dp and --nnodes must be >= 1")
        self.access = ClusterAccess(etcd=self.etcd, prefix=self.etcd_prefix,
                                    index_shards=self.index_etcd, lease_ttl=self.lease_ttl)
        if self.engine.mode == "decode" and self.dp != 1:
            raise ValueError("--dp applies to prefill instances; run more decode instances "
                             "instead")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} outside --nnodes {self.nnodes}")
        if (self.tp * self.dp) % self.nnodes:
            raise ValueError(f"tp*dp = {self.tp * self.dp} ranks cannot be split over "
                             f"--nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        if self.dist_init_addr and not _ADDR.match(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        self.engine.check_tp(self.tp)
        if self.load_balance_method not in LOAD_BALANCE:
            raise ValueError(f"--load-balance-method must be one of {LOAD_BALANCE}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"--kv-cache-dtype must be auto or one of {sorted(DTYPES)}")
        if self.transfer_backend not in BACKENDS or self.transfer_backend == "fake":
            raise ValueError("--transfer-backend must be zmq or cuda_ipc")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"--bootstrap-port must be in 0..65535, got {self.bootstrap_port}")
        if self.auth_token is not None and (not self.auth_token
                                            or any(c.isspace() for c in self.auth_token)):
            raise ValueError("--auth-token must be non-empty without whitespace; omit it (and "
                             f"{AUTH_TOKEN_ENV}) to turn bootstrap auth off")
        check_advertise_host(self.advertise_host)
        if self.local_prefill and self.engine.mode != "decode":
            raise ValueError("--local-prefill applies to decode instances (a prefill never "
                             "serves a request whole)")
        if self.engine.kv_events is not None:
            # Standalone, as SGLang runs: the instance publishes its KV events and a sidecar
            # beside it indexes them. With --etcd it indexes its own blocks instead.
            if self.engine.mode != "prefill":
                raise ValueError("--kv-events applies to prefill instances (a decode's cache "
                                 "is not indexed)")
            if self.etcd is not None:
                raise ValueError("--kv-events and --etcd exclude each other: with --etcd the "
                                 "prefill indexes its own blocks in etcd; --kv-events publishes "
                                 "them for a sidecar (kvatlas sidecar) and needs no etcd")
        if self.kv_lease_s <= 0:
            raise ValueError(f"--kv-lease must be > 0 seconds, got {self.kv_lease_s}")
        if self.pd_protocol.name != "sglang" and self.dp != 1:
            # a DP forward would lose the X-Request-Id both halves derive the room from
            raise ValueError("--pd-protocol vllm takes --dp 1; run more prefill instances "
                             "instead")
        if self.instance_id is None:
            self.instance_id = f"{self.engine.mode}-{uuid.uuid4().hex[:8]}"
        validate_instance_id(self.instance_id)

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def caches_prefixes(self) -> bool:
        """Whether this instance keeps a prefix cache: a prefill, or a decode that prefills
        locally (KV that arrives by transfer is never stored), unless
        ``--disable-prefix-cache``. A decode indexes its blocks, and states a ``block_size``
        in its record, only then."""
        return self.engine.enable_prefix_cache and (self.mode == "prefill"
                                                    or self.local_prefill)

    @property
    def kv_dtype(self) -> str:
        return self.engine.model_config.dtype if self.kv_cache_dtype == "auto" \
            else self.kv_cache_dtype

    @property
    def public_host(self) -> str:
        """The host peers dial (see ``advertise_host``)."""
        return public_host(self.engine.host, self.advertise_host)

    def identity(self, bootstrap_port: int, tp_size: int) -> PDProtocol:
        """This instance's PD protocol as its record states it and its answers name it. A vLLM
        prefill names itself as a push router must know it in advance: its instance id, and
        its bootstrap server, where decodes find its transfer ranks."""
        p = self.pd_protocol
        if p.name == "vllm" and self.mode == "prefill":
            p = PDProtocol(p.name, p.mode, engine_id=self.instance_id, host=self.public_host,
                           port=bootstrap_port, tp_size=tp_size)
        return p

    def protocol_fields(self, bootstrap_port: int, tp_size: int) -> dict[str, Any]:
        """The etcd record's ``pd_protocol`` (none for SGLang's bootstrap: the record's
        default): ``identity``."""
        p = self.identity(bootstrap_port, tp_size)
        return {} if p.name == "sglang" else {"pd_protocol": p.to_dict()}

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("prefill/decode")
        g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
        g.add_argument("--dp", type=int, default=1, help="data-parallel groups (prefill)")
        g.add_argument("--instance-id", default=None, help="instance id (etcd, bootstrap)")
        g.add_argument("--bootstrap-port", type=int, default=DEFAULT_PORT,
                       help="prefill: bootstrap server port")
        g.add_argument("--load-balance-method", default="follow_bootstrap_room",
                       choices=LOAD_BALANCE, help="prefill DP choice per request")
        g.add_argument("--kv-cache-dtype", default="auto", help="KV pool dtype (auto: model's)")
        g.add_argument("--transfer-backend", default="zmq", choices=["zmq", "cuda_ipc"])
        g.add_argument("--lease-ttl", type=int, default=DEFAULT_LEASE_TTL,
                       help="etcd instance lease TTL")
        g.add_argument("--nnodes", type=int, default=1, help="nodes of this instance")
        g.add_argument("--node-rank", type=int, default=0, help="this node's index")
        g.add_argument("--dist-init-addr", default=None, help="torch.distributed HOST:PORT")
        g.add_argument("--auth-token", default=None,
                       help="bootstrap write token (prefill: required on its bootstrap server's "
                            "PUT/POST and sent by its ranks; decode: sent to bootstrap servers); "
                            f"default: ${AUTH_TOKEN_ENV} when set")
        g.add_argument("--advertise-host", default=None,
                       help="host peers dial (etcd url, bootstrap host, rank_ip); default: "
                            "--host, or this machine's name when --host is a wildcard")
        g.add_argument("--local-prefill", action="store_true",
                       help="decode: prefill a request itself when a router asks "
                            "(X-Kvatlas-Prefill: local), so short prompts can be served whole "
                            "(default: refused, every request disaggregated)")
        g.add_argument("--pd-protocol", default="sglang", choices=CHOICES,
                       help="how routers drive the pair: SGLang's bootstrap fields (sglang) or "
                            "vLLM's kv_transfer_params (vllm = vllm-pull, vllm-push)")
        g.add_argument("--kv-lease", type=float, default=30.0, dest="kv_lease_s",
                       help="vLLM pull prefill: seconds the KV is held for its decode")
        TransferConfig.add_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, engine: EngineServerConfig,
                      access: ClusterAccess | None = None) -> PDConfig:
        """Build from parsed flags; ``access`` is what the CLI built from its etcd flags (None:
        not registered in etcd)."""
        access = access or ClusterAccess()
        return cls(engine=engine, tp=args.tp, dp=args.dp, instance_id=args.instance_id,
                   bootstrap_port=args.bootstrap_port,
                   load_balance_method=args.load_balance_method,
                   kv_cache_dtype=args.kv_cache_dtype, transfer_backend=args.transfer_backend,
                   transfer=TransferConfig.from_cli_args(args), etcd=access.etcd,
                   etcd_prefix=access.prefix, lease_ttl=args.lease_ttl, nnodes=args.nnodes,
                   node_rank=args.node_rank, dist_init_addr=args.dist_init_addr,
                   auth_token=args.auth_token or os.environ.get(AUTH_TOKEN_ENV) or None,
                   advertise_host=args.advertise_host,
                   index_etcd=access.index_shards,
                   local_prefill=args.local_prefill,
                   pd_protocol=PDProtocol.parse(args.pd_protocol), kv_lease_s=args.kv_lease_s)
