"""Decode -> prefill rank mapping, and the topology documents a decode reads from a bootstrap server.

Everything here is pure (no I/O) so that the mapping can be checked exhaustively by table and
property tests, and reused by any transport. The rules are SGLang's (``CommonKVManager.
_resolve_rank_mapping`` in ``disaggregation/common/conn.py``), so that a kvatlas decode and an SGLang
prefill (or the reverse) agree on who sends which KV to whom:

- attention TP, decode size D, prefill size P:
  D == P: decode rank e reads prefill rank e.
  D > P: D/P decode ranks share one prefill rank: e reads e // (D/P), and that prefill rank sends
  to D/P destinations (``required_dst_info_num``).
  D < P: e reads the P/D prefill ranks e*(P/D) .. (e+1)*(P/D)-1 and waits for P/D responses
  (one for MLA, where every prefill rank holds the whole latent KV).
- PP: equal sizes -> the decode's own pp rank; decode pp 1 -> every prefill pp rank (one response
  each).
- CP: decode and prefill attention CP must both be 1; other combinations are refused here rather
  than silently pulling only CP rank 0, because kvatlas's transfer layer has no CP page filter.
- Prefill DP of a request: ``room % dp_size`` when the prefill follows the room, otherwise the
  decode must ask the bootstrap server (``/query_dp_ranks``).

Unlike SGLang (which uses integer division and ``assert``), sizes that do not divide each other and
ranks out of range raise ``ValueError`` naming the sizes: a silent floor division maps ranks to
the wrong prefill rank and shows up only as corrupted output.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bootstrap.errors import TopologyMismatch

#: Keys of the topology document in SGLang's order (0.5.23), before the decode-only null fields.
TOPOLOGY_KEYS: tuple[str, ...] = (
    "attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
    "follow_bootstrap_room", "enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout",
    "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port",
)
#: Fields SGLang's PrefillServerInfo fills in on the decode side; a server always sends them null.
DECODE_SIDE_KEYS: tuple[str, ...] = (
    "target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
    "required_dst_info_num", "required_prefill_response_num",
)
#: Without these a decode cannot compute the mapping; SGLang's dataclass has no defaults for them.
_REQUIRED_KEYS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
                  "kv_cache_dtype", "follow_bootstrap_room")


def _is_int(value: object) -> bool:
    # bool is an int subclass; JSON true must not pass as a size of 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_size(name: str, value: object) -> int:
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value  # type: ignore[return-value]


def _check_rank(name: str, value: object, size: int) -> int:
    if not _is_int(value) or not 0 <= value < size:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer in [0, {size}), got {value!r}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class PrefillServerInfo:
    """The topology document: ``GET /route`` with all four ranks ``-1``.

    Parsed once per bootstrap address and cached by the client; everything a decode needs before
    it can compute which prefill ranks to read. Unknown keys are kept in ``extra`` so a newer
    server does not break an older decode.
    """

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    dsv41_spec_layout: Any = None
    kv_layout: Any = None
    decode_allocation_policy: str = "early"
    enable_kv_cache_sharding: bool = False
    prefill_http_port: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size"):
            _check_size(name, getattr(self, name))
        if self.page_size is not None:
            _check_size("page_size", self.page_size)
        if self.kv_cache_dtype is not None and (
            not isinstance(self.kv_cache_dtype, str) or not self.kv_cache_dtype
        ):
            raise ValueError(f"kv_cache_dtype must be a non-empty string, got {self.kv_cache_dtype!r}")
        for name in ("follow_bootstrap_room", "enable_dsa_cache_layer_split",
                     "enable_kv_cache_sharding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.decode_allocation_policy, str) or not self.decode_allocation_policy:
            raise ValueError(
                f"decode_allocation_policy must be a non-empty string, "
                f"got {self.decode_allocation_policy!r}"
            )
        if self.prefill_http_port is not None and (
            not _is_int(self.prefill_http_port) or not 1 <= self.prefill_http_port <= 65535
        ):
            raise ValueError(f"prefill_http_port must be in 1-65535, got {self.prefill_http_port!r}")

    @property
    def num_ranks(self) -> int:
        """Distinct rank cells the instance has once complete: ``dp * cp * tp * pp``."""
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    @classmethod
    def from_json(cls, doc: object) -> PrefillServerInfo:
        """Validate a decoded JSON topology document; ValueError names the offending field."""
        if not isinstance(doc, dict):
            raise ValueError(f"topology document must be a JSON object, got {type(doc).__name__}")
        missing = [key for key in _REQUIRED_KEYS if key not in doc]
        if missing:
            raise ValueError(f"topology document lacks {', '.join(missing)}")
        known = {key: doc[key] for key in TOPOLOGY_KEYS if key in doc}
        # Older servers (SGLang < 0.5.23) omit these; null means "server default".
        if known.get("decode_allocation_policy") is None:
            known["decode_allocation_policy"] = "early"
        for flag in ("enable_dsa_cache_layer_split", "enable_kv_cache_sharding"):
            if known.get(flag) is None:
                known[flag] = False
        extra = {k: v for k, v in doc.items() if k not in TOPOLOGY_KEYS and k not in DECODE_SIDE_KEYS}
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The document as a server sends it (SGLang's key order; null layouts left out)."""
        out: dict[str, Any] = {}
        for key in TOPOLOGY_KEYS:
            value = getattr(self, key)
            if key in ("dsv41_spec_layout", "kv_layout") and value is None:
                continue
            out[key] = value
        for key in DECODE_SIDE_KEYS:
            out[key] = None
        return out


def _valid_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    return 0 < len(text) <= 253 and all(
        0 < len(label) <= 63 and label.replace("-", "").replace("_", "").isalnum()
        for label in labels
    )


@dataclass(frozen=True)
class RankAddress:
    """One prefill rank's KV-transfer socket, from ``GET /route`` for a single cell."""

    rank_ip: str
    rank_port: int

    def __post_init__(self) -> None:
        if not isinstance(self.rank_ip, str) or not _valid_host(self.rank_ip):
            raise ValueError(f"rank_ip must be an IP address or host name, got {self.rank_ip!r}")
        if not _is_int(self.rank_port) or not 1 <= self.rank_port <= 65535:
            raise ValueError(f"rank_port must be an integer in 1-65535, got {self.rank_port!r}")

    @classmethod
    def from_json(cls, doc: object) -> RankAddress:
        if not isinstance(doc, dict):
            raise ValueError(f"rank address must be a JSON object, got {type(doc).__name__}")
        missing = [key for key in ("rank_ip", "rank_port") if key not in doc]
        if missing:
            raise ValueError(f"rank address lacks {', '.join(missing)}")
        return cls(rank_ip=doc["rank_ip"], rank_port=doc["rank_port"])

    @property
    def tcp_endpoint(self) -> str:
        """ZMQ endpoint; IPv6 literals need brackets there too."""
        host = f"[{self.rank_ip}]" if ":" in self.rank_ip else self.rank_ip
        return f"tcp://{host}:{self.rank_port}"


@dataclass(frozen=True)
class DecodeParallel:
    """Where one decode rank sits in its own instance: attention TP/CP and PP sizes and ranks."""

    attn_tp_size: int
    attn_tp_rank: int
    pp_size: int = 1
    pp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0

    def __post_init__(self) -> None:
        _check_rank("decode attn_tp_rank", self.attn_tp_rank,
                    _check_size("decode attn_tp_size", self.attn_tp_size))
        _check_rank("decode pp_rank", self.pp_rank, _check_size("decode pp_size", self.pp_size))
        _check_rank("decode attn_cp_rank", self.attn_cp_rank,
                    _check_size("decode attn_cp_size", self.attn_cp_size))


@dataclass(frozen=True)
class RankMapping:
    """Which prefill ranks one decode rank reads, and how many answers it must wait for.

    ``required_dst_info_num``: how many decode ranks read each of these prefill ranks (D/P when
    D > P, else 1); the prefill rank must see that many decode registrations before it sends.
    ``required_prefill_response_num``: how many prefill ranks must report before this decode
    rank's KV is complete.
    """

    target_tp_ranks: tuple[int, ...]
    target_cp_ranks: tuple[int, ...]
    target_pp_ranks: tuple[int, ...]
    required_dst_info_num: int
    required_prefill_response_num: int

    @property
    def target_tp_rank(self) -> int:
        """The one prefill TP rank whose KV is authoritative (the first of the targets)."""
        return self.target_tp_ranks[0]

    def cells(self, dp: int) -> list[tuple[int, int, int, int]]:
        """Every ``(dp, cp, tp, pp)`` cell to look up for a request whose prefill DP is ``dp``."""
        if not _is_int(dp) or dp < 0:
            raise ValueError(f"prefill dp rank must be an integer >= 0, got {dp!r}")
        return [(dp, cp, tp, pp) for cp in self.target_cp_ranks for tp in self.target_tp_ranks
                for pp in self.target_pp_ranks]


def _ratio(what: str, decode_size: int, prefill_size: int) -> int:
    big, small = max(decode_size, prefill_size), min(decode_size, prefill_size)
    if big % small:
        raise ValueError(
            f"decode {what} {decode_size} and prefill {what} {prefill_size} do not divide each "
            f"other; pick sizes where one is a multiple of the other"
        )
    return big // small


def tp_targets(decode_tp_size: int, decode_tp_rank: int, prefill_tp_size: int) -> tuple[int, ...]:
    """Prefill attention-TP ranks that decode attention-TP rank ``decode_tp_rank`` reads."""
    _check_rank("decode attn_tp_rank", decode_tp_rank, _check_size("decode attn_tp_size", decode_tp_size))
    _check_size("prefill attn_tp_size", prefill_tp_size)
    ratio = _ratio("attn_tp_size", decode_tp_size, prefill_tp_size)
    if decode_tp_size >= prefill_tp_size:
        return (decode_tp_rank // ratio,)
    return tuple(range(decode_tp_rank * ratio, (decode_tp_rank + 1) * ratio))


def tp_readers(prefill_tp_rank: int, prefill_tp_size: int, decode_tp_size: int) -> tuple[int, ...]:
    """Decode attention-TP ranks that read prefill rank ``prefill_tp_rank``: the inverse of
    ``tp_targets``. With D > P these are the D/P decode ranks that share it."""
    _check_rank("prefill attn_tp_rank", prefill_tp_rank, _check_size("prefill attn_tp_size", prefill_tp_size))
    _check_size("decode attn_tp_size", decode_tp_size)
    ratio = _ratio("attn_tp_size", decode_tp_size, prefill_tp_size)
    if decode_tp_size >= prefill_tp_size:
        return tuple(range(prefill_tp_rank * ratio, (prefill_tp_rank + 1) * ratio))
    return (prefill_tp_rank // ratio,)


def pp_targets(decode_pp_size: int, decode_pp_rank: int, prefill_pp_size: int) -> tuple[int, ...]:
    """Prefill PP ranks that decode PP rank ``decode_pp_rank`` reads (own rank, or all when the
    decode has pp 1)."""
    _check_rank("decode pp_rank", decode_pp_rank, _check_size("decode pp_size", decode_pp_size))
    _check_size("prefill pp_size", prefill_pp_size)
    if decode_pp_size == prefill_pp_size:
        return (decode_pp_rank,)
    if decode_pp_size == 1:
        return tuple(range(prefill_pp_size))
    raise ValueError(
        f"decode pp_size {decode_pp_size} with prefill pp_size {prefill_pp_size} is not supported: "
        "decode pp_size must equal the prefill's or be 1"
    )


def pp_readers(prefill_pp_rank: int, prefill_pp_size: int, decode_pp_size: int) -> tuple[int, ...]:
    """Decode PP ranks that read prefill PP rank ``prefill_pp_rank``: the inverse of ``pp_targets``."""
    _check_rank("prefill pp_rank", prefill_pp_rank, _check_size("prefill pp_size", prefill_pp_size))
    pp_targets(decode_pp_size, 0, prefill_pp_size)  # same validation of the size pair
    return (0,) if decode_pp_size == 1 else (prefill_pp_rank,)


def cp_targets(decode_cp_size: int, prefill_cp_size: int) -> tuple[int, ...]:
    """Prefill CP ranks to read: only CP 1 on both sides is supported, so always ``(0,)``."""
    _check_size("decode attn_cp_size", decode_cp_size)
    _check_size("prefill attn_cp_size", prefill_cp_size)
    if decode_cp_size != 1 or prefill_cp_size != 1:
        raise ValueError(
            f"decode attn_cp_size {decode_cp_size} with prefill attn_cp_size {prefill_cp_size} is "
            "not supported: kvatlas transfers KV only between instances with attention CP 1 on "
            "both sides; run both with --attn-cp-size 1"
        )
    return (0,)


def map_decode_rank(decode: DecodeParallel, prefill: PrefillServerInfo, *, mla: bool = False) -> RankMapping:
    """The full mapping for one decode rank against one prefill instance's topology.

    ``mla``: the model uses MLA (one latent KV replicated on every TP rank). With D < P the decode
    still connects to all P/D prefill ranks, but only one of them sends real KV, so it waits for a
    single response, as SGLang does.
    """
    cp = cp_targets(decode.attn_cp_size, prefill.attn_cp_size)
    tp = tp_targets(decode.attn_tp_size, decode.attn_tp_rank, prefill.attn_tp_size)
    pp = pp_targets(decode.pp_size, decode.pp_rank, prefill.pp_size)
    if decode.attn_tp_size > prefill.attn_tp_size:
        dst_num = decode.attn_tp_size // prefill.attn_tp_size
        responses = 1
    else:
        dst_num = 1
        responses = 1 if mla else len(tp)
    responses *= len(cp) * len(pp)
    return RankMapping(target_tp_ranks=tp, target_cp_ranks=cp, target_pp_ranks=pp,
                       required_dst_info_num=dst_num, required_prefill_response_num=responses)


def check_kv_compat(
    prefill: PrefillServerInfo, *, page_size: int, kv_cache_dtype: str, addr: str = ""
) -> None:
    """Refuse a prefill whose KV pages the decode could not read as-is.

    A prefill that reports null for a value (SGLang before the field existed) is not checked on
    it, as SGLang's decode does; everything kvatlas serves reports both.
    """
    if prefill.page_size is not None and prefill.page_size != page_size:
        raise TopologyMismatch("page_size", page_size, prefill.page_size, addr=addr,
                               hint="start decode and prefill with the same --page-size")
    if prefill.kv_cache_dtype is not None and prefill.kv_cache_dtype != kv_cache_dtype:
        raise TopologyMismatch("kv_cache_dtype", kv_cache_dtype, prefill.kv_cache_dtype, addr=addr,
                               hint="start decode and prefill with the same --kv-cache-dtype")


def prefill_dp_for_room(room: int, prefill: PrefillServerInfo) -> int | None:
    """The prefill DP rank that serves ``room``, or None when the decode must ask the bootstrap
    server (``/query_dp_ranks``) because the prefill balances DP some other way."""
    if not _is_int(room) or room < 0:
        raise ValueError(f"bootstrap_room must be an integer >= 0, got {room!r}")
    if prefill.dp_size == 1:
        return 0
    if prefill.follow_bootstrap_room:
        return room % prefill.dp_size
    return None
