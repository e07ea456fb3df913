"""The authoritative in-memory rank table ``(dp, cp, tp, pp) -> (rank_ip, rank_port)``.

Pure data: validation of one ``PUT /route`` registration, the topology taken from the first
registrant, contradiction checks, and readiness by distinct cells. No I/O, no clock but ``time``.
"""
from __future__ import annotations

import ipaddress
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from bootstrap.errors import RegistrationError  # raised here; callers may import it from here

logger = logging.getLogger(__name__)

Cell = tuple[int, int, int, int]  # (dp, cp, tp, pp)

MAX_SIZE = 4096          # any one parallel size
MAX_CELLS = 65536        # dp * cp * tp * pp

# Fields whose disagreement with the registered topology is refused with 409.
CONFLICT_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
                   "kv_cache_dtype", "decode_allocation_policy", "dsv41_spec_layout", "kv_layout")
# The decode-side fields of SGLang's PrefillServerInfo; the prefill always leaves them null.
DECODE_NULL_FIELDS = ("target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
                      "required_dst_info_num", "required_prefill_response_num")

_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


@dataclass(frozen=True)
class Topology:
    """The instance-wide scalars, fixed by the first registrant."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int
    kv_cache_dtype: str
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool
    dsv41_spec_layout: Any
    kv_layout: Any
    decode_allocation_policy: str
    enable_kv_cache_sharding: bool
    prefill_http_port: int | None

    @property
    def expected(self) -> int:
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    def document(self) -> dict[str, Any]:
        """SGLang's PrefillServerInfo, in its key order (layouts left out when null)."""
        doc: dict[str, Any] = {
            "attn_tp_size": self.attn_tp_size,
            "attn_cp_size": self.attn_cp_size,
            "dp_size": self.dp_size,
            "pp_size": self.pp_size,
            "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "follow_bootstrap_room": self.follow_bootstrap_room,
            "enable_dsa_cache_layer_split": self.enable_dsa_cache_layer_split,
        }
        if self.dsv41_spec_layout is not None:
            doc["dsv41_spec_layout"] = self.dsv41_spec_layout
        if self.kv_layout is not None:
            doc["kv_layout"] = self.kv_layout
        doc["decode_allocation_policy"] = self.decode_allocation_policy
        doc["enable_kv_cache_sharding"] = self.enable_kv_cache_sharding
        doc["prefill_http_port"] = self.prefill_http_port
        for name in DECODE_NULL_FIELDS:
            doc[name] = None
        return doc

    def scalars(self) -> dict[str, Any]:
        """The topology without the decode-side nulls (for /table and the etcd mirror)."""
        doc = self.document()
        for name in DECODE_NULL_FIELDS:
            del doc[name]
        return doc


@dataclass(frozen=True)
class Registration:
    """One validated ``PUT /route`` body."""

    cell: Cell
    rank_ip: str
    rank_port: int
    topology: Topology
    attn_dp_rank: int
    system_dp_rank: int


@dataclass(frozen=True)
class RankEntry:
    rank_ip: str
    rank_port: int
    registered_at: float
    attn_dp_rank: int | None
    """None where unknown: a table read from another server (a sidecar polling SGLang's) learns
    only each cell's address."""
    system_dp_rank: int | None

    def address(self) -> dict[str, Any]:
        """SGLang's PrefillRankInfo."""
        return {"rank_ip": self.rank_ip, "rank_port": self.rank_port}


# --- validation ------------------------------------------------------------------------------


def _missing(name: str) -> RegistrationError:
    return RegistrationError(400, f"missing field '{name}'", name)


def _int(body: dict[str, Any], name: str, *, lenient: bool = False,
         default: Any = ..., ) -> Any:
    """An integer field. ``lenient`` also takes a decimal string, as SGLang's ``int()`` does."""
    if name not in body:
        if default is ...:
            raise _missing(name)
        return default
    value = body[name]
    if value is None and default is not ...:
        return default
    if isinstance(value, bool):
        raise RegistrationError(400, f"field '{name}' must be an integer, got a boolean", name)
    if isinstance(value, int):
        return value
    if lenient and isinstance(value, str) and re.fullmatch(r"\s*-?\d{1,10}\s*", value):
        return int(value)
    raise RegistrationError(400, f"field '{name}' must be an integer, got {type(value).__name__}",
                            name)


def _str(body: dict[str, Any], name: str, default: Any = ...) -> Any:
    if name not in body or (body[name] is None and default is not ...):
        if default is ...:
            raise _missing(name)
        return default
    value = body[name]
    if not isinstance(value, str) or not value:
        raise RegistrationError(400, f"field '{name}' must be a non-empty string", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RegistrationError(400, f"field '{name}' must be a boolean, got {type(value).__name__}",
                                name)
    return value


def _size(body: dict[str, Any], name: str) -> int:
    value = _int(body, name)
    if not 1 <= value <= MAX_SIZE:
        raise RegistrationError(400, f"field '{name}' must be between 1 and {MAX_SIZE}, got {value}",
                                name)
    return value


def _rank(body: dict[str, Any], name: str, size_name: str, size: int) -> int:
    value = _int(body, name)
    if not 0 <= value < size:
        raise RegistrationError(
            400, f"field '{name}' must be in 0..{size - 1} ({size_name} is {size}), got {value}", name)
    return value


def _port(value: int, name: str) -> int:
    if not 1 <= value <= 65535:
        raise RegistrationError(400, f"field '{name}' must be a port in 1-65535, got {value}", name)
    return value


def validate_host(value: str, name: str = "rank_ip") -> str:
    """An IPv4/IPv6 literal or a DNS host name; anything else is refused."""
    host = value.strip()
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
        if not bracketed or ip.version == 6:  # brackets only ever wrap an IPv6 literal
            return host
    except ValueError:
        pass
    # A dotted all-numeric string that is not a valid IPv4 (e.g. 300.1.1.1) is a typo, not a name.
    # fullmatch, not match: "$" would let a trailing newline through into the table and the logs.
    if not bracketed and _HOSTNAME_RE.fullmatch(host) and not re.fullmatch(r"[\d.]+", host):
        return host
    raise RegistrationError(400, f"field '{name}' is not an IP address or host name: {value!r}",
                            name)


def parse_registration(body: Any) -> Registration:
    """Validate one registration body (unknown extra fields are ignored)."""
    if not isinstance(body, dict):
        raise RegistrationError(400, "body must be a JSON object")
    attn_tp_size = _size(body, "attn_tp_size")
    attn_cp_size = _size(body, "attn_cp_size")
    attn_dp_size = _size(body, "attn_dp_size")
    pp_size = _size(body, "pp_size")
    system_dp_size = _size(body, "system_dp_size")
    tp = _rank(body, "attn_tp_rank", "attn_tp_size", attn_tp_size)
    cp = _rank(body, "attn_cp_rank", "attn_cp_size", attn_cp_size)
    attn_dp_rank = _rank(body, "attn_dp_rank", "attn_dp_size", attn_dp_size)
    pp = _rank(body, "pp_rank", "pp_size", pp_size)
    system_dp_rank = _rank(body, "system_dp_rank", "system_dp_size", system_dp_size)
    rank_ip = validate_host(_str(body, "rank_ip"))
    rank_port = _port(_int(body, "rank_port", lenient=True), "rank_port")
    page_size = _int(body, "page_size", lenient=True)
    if page_size < 1:
        raise RegistrationError(400, f"field 'page_size' must be at least 1, got {page_size}",
                                "page_size")
    kv_cache_dtype = _str(body, "kv_cache_dtype")
    prefill_http_port = _int(body, "prefill_http_port", lenient=True, default=None)
    if prefill_http_port is not None:
        _port(prefill_http_port, "prefill_http_port")
    load_balance_method = _str(body, "load_balance_method", default="follow_bootstrap_room")
    decode_allocation_policy = _str(body, "decode_allocation_policy", default="early")

    # SGLang's rule: with system DP the system rank picks the row, else the attention DP rank.
    dp_size = attn_dp_size if system_dp_size == 1 else system_dp_size
    dp = attn_dp_rank if system_dp_size == 1 else system_dp_rank
    cells = dp_size * attn_cp_size * attn_tp_size * pp_size
    if cells > MAX_CELLS:
        raise RegistrationError(
            400, f"dp*cp*tp*pp = {cells} ranks exceeds the supported {MAX_CELLS}", "attn_tp_size")
    topology = Topology(
        attn_tp_size=attn_tp_size, attn_cp_size=attn_cp_size, dp_size=dp_size, pp_size=pp_size,
        page_size=page_size, kv_cache_dtype=kv_cache_dtype,
        follow_bootstrap_room=load_balance_method == "follow_bootstrap_room",
        enable_dsa_cache_layer_split=_bool(body, "enable_dsa_cache_layer_split"),
        dsv41_spec_layout=body.get("dsv41_spec_layout"), kv_layout=body.get("kv_layout"),
        decode_allocation_policy=decode_allocation_policy,
        enable_kv_cache_sharding=_bool(body, "enable_kv_cache_sharding"),
        prefill_http_port=prefill_http_port,
    )
    return Registration(cell=(dp, cp, tp, pp), rank_ip=rank_ip, rank_port=rank_port,
                        topology=topology, attn_dp_rank=attn_dp_rank, system_dp_rank=system_dp_rank)


# --- the table -------------------------------------------------------------------------------


class RankTable:
    """The rank table of one prefill instance; ready when every distinct cell is registered."""

    def __init__(self) -> None:
        self.topology: Topology | None = None
        self.cells: dict[Cell, RankEntry] = {}

    @property
    def registered(self) -> int:
        return len(self.cells)

    @property
    def expected(self) -> int | None:
        return None if self.topology is None else self.topology.expected

    @property
    def ready(self) -> bool:
        return self.topology is not None and len(self.cells) >= self.topology.expected

    def register(self, reg: Registration) -> str:
        """Store ``reg``; returns "new", "replaced" or "unchanged". Raises 409 on contradiction."""
        if self.topology is None:
            self.topology = reg.topology
        else:
            for name in CONFLICT_FIELDS:
                have, got = getattr(self.topology, name), getattr(reg.topology, name)
                if have != got:
                    raise RegistrationError(
                        409,
                        f"{name} {got!r} contradicts the registered {name} {have!r} of this "
                        f"instance (set by its first rank); every rank of one instance must share "
                        f"one topology, so restart the instance if its topology changed",
                        name,
                    )
        old = self.cells.get(reg.cell)
        self.cells[reg.cell] = RankEntry(reg.rank_ip, reg.rank_port, time.time(),
                                         reg.attn_dp_rank, reg.system_dp_rank)
        if old is None:
            return "new"
        if (old.rank_ip, old.rank_port) == (reg.rank_ip, reg.rank_port):
            return "unchanged"
        logger.warning("rank dp=%d cp=%d tp=%d pp=%d re-registered: %s:%d replaces %s:%d",
                       *reg.cell, reg.rank_ip, reg.rank_port, old.rank_ip, old.rank_port)
        return "replaced"

    def lookup(self, cell: Cell) -> RankEntry | None:
        return self.cells.get(cell)

    def snapshot(self) -> dict[str, Any]:
        """The whole table as JSON-ready data (``GET /table``)."""
        return {
            "ready": self.ready,
            "registered_ranks": self.registered,
            "expected_ranks": self.expected,
            "topology": None if self.topology is None else self.topology.scalars(),
            "ranks": [
                {"dp": c[0], "cp": c[1], "tp": c[2], "pp": c[3], **e.address(),
                 "registered_at": e.registered_at}
                for c, e in sorted(self.cells.items())
            ],
        }
