"""The instance record: the etcd value at ``/{prefix}/v1/instances/{id}``, one typed schema.

Every writer (the bootstrap mirror of a prefill, a decode's own record, the index agent) builds
an ``InstanceRecord`` and every reader (router discovery, the decode's restart watch, the id
claim, the CLI and ``doctor``) parses one, so the fields cannot drift apart between them.

The value is JSON (``etcdctl get`` stays readable) with ``"v": 1``. Every known field is always
written, ``null`` where unknown, so a reader never has to guess whether a field is missing or
empty. Rules for readers:

- a record without ``v`` was written by an older kvatlas and is read as version 1;
- a ``v`` above ``RECORD_VERSION`` is refused (reason ``newer_version``; the message names both
  versions): its fields may mean something else, so it is not guessed at;
- not JSON, not an object, a missing or invalid ``instance_id``/``role``, or a known field of
  the wrong type is refused (reason ``malformed``);
- a record without ``instance_id`` takes the id from its key (``from_json(instance_id=...)``);
- fields this version does not know are kept in ``extra`` and written back by ``to_json``, so a
  read-modify-write by an older process does not drop what a newer one added.

``RecordReader`` is the never-raising front for watch loops: it counts refusals by reason and
logs each (key, reason) once, not on every watch event.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from index.errors import RecordError
from index.hashing import BASE_SEED, namespace_seed
from index.keys import dumps, validate_instance_id
from index.pd_protocol import SGLANG_BOOTSTRAP, PDProtocol

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
"""The record version this kvatlas writes and the newest it reads."""

PREFILL, DECODE, AGGREGATED = "prefill", "decode", "aggregated"
"""An ``aggregated`` instance prefills and decodes its own requests (no PD pair): a router
sends it whole requests, with no bootstrap fields."""
MONOLITHIC = "monolithic"
"""The name records used for ``aggregated`` before it had routers; read as ``aggregated``."""
ROLES = (PREFILL, DECODE, AGGREGATED)

DEFAULT_ENGINE = "kvatlas"
"""The engine kind of a record that names none (every record written before ``engine``)."""
ENGINE_UNKNOWN = "unknown"
"""The engine kind the index agent writes: it sees only KV events, not which engine sends them."""

MALFORMED = "malformed"
NEWER_VERSION = "newer_version"
REASONS = (MALFORMED, NEWER_VERSION)


@dataclass(frozen=True)
class HashNamespace:
    """The block-hash namespace of an instance (``index.hashing.namespace_seed``).

    An instance without one (``hash_namespace: null``) hashes with the base seed. JSON form:
    ``{"lora_name": str | null, "cache_salt": str | null}``.
    """

    lora_name: str | None = None
    cache_salt: str | None = None

    @property
    def seed(self) -> int:
        return namespace_seed(self.lora_name, self.cache_salt)

    def to_dict(self) -> dict[str, Any]:
        return {"lora_name": self.lora_name, "cache_salt": self.cache_salt}


# --- field checks: each returns the value to store or raises ValueError saying what is wrong --

def _opt(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {type(v).__name__}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def check(v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"must be an integer, got {type(v).__name__}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"must be within [{lo}, {hi if hi is not None else '...'}], got {v}")
        return v
    return check


def _number(v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"must be a number, got {type(v).__name__}")
    # JSON as Python reads it takes NaN and Infinity: no time a process started (and a NaN
    # never equals itself, so a restart watch would see a new process on every put).
    if not math.isfinite(v):
        raise ValueError(f"must be a finite number, got {v}")
    return v


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {type(v).__name__}")
    return v


def _object(v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"must be an object, got {type(v).__name__}")
    return dict(v)


def _tokenizer(v: Any) -> str | dict[str, Any]:
    if not isinstance(v, (str, dict)):
        raise ValueError(f"must be a string or an object, got {type(v).__name__}")
    return v


def named_tokenizer(value: Any) -> tuple[str | None, str | None] | None:
    """(source, fingerprint) a record's ``tokenizer`` field names: a string is a source without a
    fingerprint, an object has ``source`` and ``fingerprint`` (either may be missing: None).
    None when it names no tokenizer (null, empty, or written before the field existed)."""
    if isinstance(value, str):
        return (value, None) if value else None
    if isinstance(value, dict):
        source, fp = value.get("source"), value.get("fingerprint")
        return (source if isinstance(source, str) and source else None,
                fp if isinstance(fp, str) and fp else None)
    return None


def _namespace(v: Any) -> HashNamespace:
    if not isinstance(v, dict):
        raise ValueError(f"must be an object or null, got {type(v).__name__}")
    lora, salt = v.get("lora_name"), v.get("cache_salt")
    for name, part in (("lora_name", lora), ("cache_salt", salt)):
        if part is not None and not isinstance(part, str):
            raise ValueError(f"{name} must be a string or null, got {type(part).__name__}")
    return HashNamespace(lora, salt)


def _role(v: Any) -> str:
    if v == MONOLITHIC:
        return AGGREGATED
    if v not in ROLES:
        raise ValueError(f"must be one of {list(ROLES)}, got {v!r}")
    return v


def _with_default(check: Callable[[Any], Any], default: Any) -> Callable[[Any], Any]:
    # null in a field with a default reads as the default (what an older writer meant).
    return lambda v: default if v is None else check(v)


_PORT = _int(1, 65535)
_SIZE = _int(1)
_COUNT = _int(0)

_CHECKS: dict[str, Callable[[Any], Any]] = {
    "model": _opt(_str),
    "url": _opt(_str),
    "bootstrap_host": _opt(_str),
    "bootstrap_port": _opt(_PORT),
    "tp_size": _opt(_SIZE),
    "dp_size": _opt(_SIZE),
    "pp_size": _with_default(_SIZE, 1),
    "cp_size": _with_default(_SIZE, 1),
    "page_size": _opt(_SIZE),
    "block_size": _opt(_SIZE),
    "hash_namespace": _opt(_namespace),
    "started_at": _opt(_number),
    "ready": _with_default(_bool, True),
    "healthy": _with_default(_bool, True),
    "source": _opt(_str),
    "tokenizer": _opt(_tokenizer),
    "engine": _with_default(_str, DEFAULT_ENGINE),
    "kv_cache_dtype": _opt(_str),
    "kv_events": _opt(_str),
    "expected_ranks": _opt(_COUNT),
    "registered_ranks": _opt(_COUNT),
    "topology": _opt(_object),
    # The router's limits judge the values (router/limits.py); the record checks the type only.
    "max_prompt_tokens": _opt(_int()),
    "max_body_bytes": _opt(_int()),
    "context_length": _opt(_int()),
    "max_running_requests": _opt(_int()),
    "max_total_num_tokens": _opt(_int()),
    "local_prefill": _with_default(_bool, False),
    "pd_protocol": PDProtocol.from_dict,
}


def _key_text(key: bytes | str) -> str:
    return key.decode(errors="replace") if isinstance(key, bytes) else key


@dataclass(frozen=True)
class InstanceRecord:
    """Which instance this is, as every router, decode and CLI sees it (JSON in etcd)."""

    instance_id: str
    role: str
    """``prefill``, ``decode`` or ``aggregated`` (``monolithic`` in a record reads as it)."""
    model: str | None = None
    url: str | None = None
    """The instance's HTTP base URL; a router skips a record without a usable one."""
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    """Where decodes reach a prefill's bootstrap server (None: the router's default 8998)."""
    tp_size: int | None = None
    dp_size: int | None = None
    pp_size: int = 1
    cp_size: int = 1
    page_size: int | None = None
    """KV page size in tokens (the engine's)."""
    block_size: int | None = None
    """Index block size in tokens (the hash's)."""
    hash_namespace: HashNamespace | None = None
    """None: the base model's namespace (seed ``BASE_SEED``)."""
    started_at: float | None = None
    """Start time (Unix seconds) of the writing process: a new value is a new process."""
    ready: bool = True
    """False: listed but never chosen (e.g. ranks still registering)."""
    healthy: bool = True
    """False: the engine stopped answering its health check (a sidecar's verdict); never chosen
    while false. Kept apart from ``ready`` so that operators see which of the two it is."""
    source: str | None = None
    """Who wrote it when not the instance itself: ``"kv-events"`` for the index agent."""
    tokenizer: str | dict[str, Any] | None = None
    engine: str = DEFAULT_ENGINE
    kv_cache_dtype: str | None = None
    kv_events: str | None = None
    """The KV-event endpoint the index agent subscribes to."""
    expected_ranks: int | None = None
    registered_ranks: int | None = None
    topology: dict[str, Any] | None = None
    """A prefill's registered topology (``bootstrap.table.Topology.scalars()``), once known."""
    max_prompt_tokens: int | None = None
    max_body_bytes: int | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    """Requests the engine runs at once; a router puts no more on it (router/capacity.py)."""
    max_total_num_tokens: int | None = None
    """The engine's KV pool in tokens (pages x ``page_size``): what a router's requests there may
    need at once."""
    local_prefill: bool = False
    """A decode that also prefills a request itself, from its own prefix cache, when a router
    sends it one with ``X-Kvatlas-Prefill: local`` and no bootstrap fields (its blocks are then
    indexed under its lease): a router may serve a short prompt there whole."""
    pd_protocol: PDProtocol = SGLANG_BOOTSTRAP
    """A prefill's or decode's PD protocol (``index.pd_protocol``): SGLang's bootstrap (JSON
    null) or vLLM's ``kv_transfer_params`` in pull or push mode, with a push prefill's identity."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields this version does not know; written back unchanged."""

    def __post_init__(self) -> None:
        # Writers get the same checks as readers: a record we write always parses back.
        validate_instance_id(self.instance_id)
        for name, check in (("role", _role), *_CHECKS.items()):
            value = getattr(self, name)
            if name == "hash_namespace" and (value is None or isinstance(value, HashNamespace)):
                continue
            if name == "pd_protocol" and isinstance(value, PDProtocol):
                continue
            try:
                # Stores the checked form: null in a defaulted field becomes the default.
                object.__setattr__(self, name, check(value))
            except ValueError as exc:
                raise ValueError(f"instance record field {name} {exc}") from None
        clash = set(self.extra) & (_KNOWN | {"v"})
        if clash:
            raise ValueError(f"extra fields {sorted(clash)} are record fields; set them directly")

    # --- writing ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: ``v``, every known field (None as null), then ``extra``."""
        doc: dict[str, Any] = dict(self.extra)
        for f in _FIELDS:
            value = getattr(self, f)
            if isinstance(value, (HashNamespace, PDProtocol)):
                value = value.to_dict()
            doc[f] = value
        doc["v"] = RECORD_VERSION
        return doc

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    def replace(self, **changes: Any) -> InstanceRecord:
        """A copy with ``changes`` (``extra`` kept): the modify step of a read-modify-write."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def build(cls, fields: Mapping[str, Any], **core: Any) -> InstanceRecord:
        """A record from loose ``fields`` (known ones as fields, the rest into ``extra``) and
        ``core`` fields, which win over ``fields`` of the same name."""
        merged = {**fields, **core}
        merged.pop("v", None)
        extra = {k: v for k, v in merged.items() if k not in _KNOWN and k != "extra"}
        known = {k: v for k, v in merged.items() if k in _KNOWN}
        return cls(**known, extra=extra)

    @property
    def hash_seed(self) -> int:
        return BASE_SEED if self.hash_namespace is None else self.hash_namespace.seed

    # --- reading ----------------------------------------------------------------------------

    @classmethod
    def from_json(cls, raw: bytes | str, key: bytes | str = "",
                  instance_id: str | None = None) -> InstanceRecord:
        """Parse an etcd value; RecordError (with ``key`` and a reason) when it is unusable.

        ``instance_id`` (normally the one in the key) stands in for a record without one."""
        k = _key_text(key)
        try:
            doc = json.loads(raw)
        except (ValueError, TypeError, RecursionError) as exc:  # UnicodeDecodeError included
            raise RecordError(k, MALFORMED, f"not JSON ({type(exc).__name__})") from None
        return cls.from_dict(doc, key=k, instance_id=instance_id)

    @classmethod
    def from_dict(cls, doc: Any, key: bytes | str = "",
                  instance_id: str | None = None) -> InstanceRecord:
        k = _key_text(key)
        if not isinstance(doc, dict):
            raise RecordError(k, MALFORMED, f"not a JSON object but {type(doc).__name__}")
        v = doc.get("v", RECORD_VERSION)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise RecordError(k, MALFORMED, f"version v={v!r} is not a positive integer")
        if v > RECORD_VERSION:
            raise RecordError(k, NEWER_VERSION,
                              f"record version {v} is newer than version {RECORD_VERSION}, the "
                              "newest this kvatlas reads: upgrade this process")
        iid = doc.get("instance_id", instance_id)
        if iid is None:
            raise RecordError(k, MALFORMED, "missing instance_id")
        try:
            validate_instance_id(iid)
        except ValueError as exc:
            raise RecordError(k, MALFORMED, str(exc)) from None
        if "role" not in doc:
            raise RecordError(k, MALFORMED, "missing role")
        values: dict[str, Any] = {"instance_id": iid}
        for name, check in (("role", _role), *_CHECKS.items()):
            if name not in doc and name != "role":
                continue  # the dataclass default
            try:
                values[name] = check(doc.get(name))
            except ValueError as exc:
                raise RecordError(k, MALFORMED, f"field {name} {exc}") from None
        extra = {n: val for n, val in doc.items() if n not in _KNOWN and n != "v"}
        try:
            return cls(**values, extra=extra)
        except (ValueError, TypeError) as exc:  # the writer's checks: one error from a reader
            raise RecordError(k, MALFORMED, str(exc)) from None


_FIELDS = tuple(f.name for f in dataclasses.fields(InstanceRecord) if f.name != "extra")
_KNOWN = frozenset(_FIELDS)


class RecordReader:
    """Parses records for a watch loop: never raises, counts refusals, logs each once.

    A refused record is logged once per (key, reason); after the key reads valid again or is
    deleted (``forget``), a new refusal is logged again. ``refused`` counts every refusal, also
    the ones not logged, for metrics."""

    def __init__(self, what: str = "instance record") -> None:
        self.what = what
        self.refused: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._logged: dict[str, set[str]] = {}

    def read(self, key: bytes | str, raw: bytes | str,
             instance_id: str | None = None) -> InstanceRecord | None:
        k = _key_text(key)
        try:
            rec = InstanceRecord.from_json(raw, key=k, instance_id=instance_id)
        except RecordError as exc:
            self._refuse(k, exc.reason, str(exc))
            return None
        except Exception as exc:  # noqa: BLE001 - a watch loop must not die of one bad value
            self._refuse(k, MALFORMED, f"instance record {k}: unreadable ({exc!r})")
            return None
        self._logged.pop(k, None)
        return rec

    def forget(self, key: bytes | str) -> None:
        """The key was deleted: a later bad value under it is logged again."""
        self._logged.pop(_key_text(key), None)

    def stats(self) -> dict[str, int]:
        return dict(self.refused)

    def _refuse(self, key: str, reason: str, message: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        seen = self._logged.setdefault(key, set())
        if reason not in seen:
            seen.add(reason)
            logger.warning("%s ignored (%s): %s", self.what, reason, message)
