"""The etcd key layout of docs/architecture.md. Values are JSON so that ``etcdctl get --prefix`` is
readable, except the block segments' and the routers' predictions (binary: ``kvatlas index dump``
prints a segment readably).

``/{prefix}/v1/instances/{instance_id}``
``/{prefix}/v1/ranks/{instance_id}/{dp}/{cp}/{tp}/{pp}``
``/{prefix}/v2/blocks/{model}/{instance_id}/{segment:016x}`` (a chain segment of blocks)
``/{prefix}/v1/predictions/{router_id}/{slot:03d}`` (routers' recent routing predictions)

Model names may contain ``/`` (``org/name``), so they are percent-encoded in the path.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from index.errors import MalformedKey

DEFAULT_PREFIX = "/kvatlas"
"""The etcd key prefix every component uses unless told otherwise (``--etcd-prefix``)."""

_HASH_RE = re.compile(r"[0-9a-f]{16}")
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,5}")
_SLOT_RE = re.compile(r"[0-9]{3}")


def validate_instance_id(instance_id: str) -> str:
    """Return ``instance_id`` or raise ValueError saying what a valid id looks like."""
    if not isinstance(instance_id, str) or not _INSTANCE_RE.match(instance_id):
        raise ValueError(
            f"instance id {instance_id!r} is invalid: use 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return instance_id


def validate_model(model: str) -> str:
    if not isinstance(model, str) or not model or len(model) > 256 or not model.isprintable():
        raise ValueError(f"model name {model!r} is invalid: use 1-256 printable characters")
    return model


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def loads(raw: bytes) -> Any:
    return json.loads(raw)


@dataclass(frozen=True)
class KeyLayout:
    """Builds and parses kvatlas's etcd keys under one prefix (default ``/kvatlas``)."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/") or "//" in self.prefix:
            raise ValueError(
                f"etcd key prefix {self.prefix!r} must start with '/' and not end with '/'"
            )

    @property
    def root(self) -> str:
        return f"{self.prefix}/v1/"

    # instances
    def instances_prefix(self) -> bytes:
        return f"{self.root}instances/".encode()

    def instance(self, instance_id: str) -> bytes:
        return f"{self.root}instances/{instance_id}".encode()

    def parse_instance(self, key: bytes) -> str:
        """The instance id of an instance key; MalformedKey for any other key."""
        iid = _tail(key, self.instances_prefix())
        try:
            return validate_instance_id(iid)
        except ValueError as exc:
            raise MalformedKey(key, str(exc)) from None

    # ranks
    def ranks_prefix(self, instance_id: str | None = None) -> bytes:
        tail = f"{instance_id}/" if instance_id is not None else ""
        return f"{self.root}ranks/{tail}".encode()

    def rank(self, instance_id: str, dp: int, cp: int, tp: int, pp: int) -> bytes:
        return f"{self.root}ranks/{instance_id}/{dp}/{cp}/{tp}/{pp}".encode()

    def parse_rank(self, key: bytes) -> tuple[str, tuple[int, int, int, int]]:
        """(instance id, (dp, cp, tp, pp)) of a rank key; MalformedKey for any other key."""
        parts = _tail(key, self.ranks_prefix()).split("/")
        # Only the canonical decimal form ``rank()`` writes: int() alone takes "+1", " 1", "１".
        if (len(parts) != 5 or not all(_INDEX_RE.fullmatch(p) for p in parts[1:])
                or not _INSTANCE_RE.match(parts[0])):
            raise MalformedKey(key, "not a rank key: want {instance}/{dp}/{cp}/{tp}/{pp}")
        iid, dp, cp, tp, pp = parts
        return iid, (int(dp), int(cp), int(tp), int(pp))

    # blocks: chain segments (index/segments.py), at key version v2
    @property
    def blocks_root(self) -> str:
        return f"{self.prefix}/v2/blocks/"

    def blocks_prefix(self, model: str | None = None, instance_id: str | None = None) -> bytes:
        if model is None:
            return self.blocks_root.encode()
        tail = f"{instance_id}/" if instance_id is not None else ""
        return f"{self.blocks_root}{quote(model, safe='')}/{tail}".encode()

    def segment(self, model: str, instance_id: str, segment: int) -> bytes:
        return f"{self.blocks_root}{quote(model, safe='')}/{instance_id}/{segment:016x}".encode()

    def parse_segment(self, key: bytes) -> tuple[str, str, int]:
        """(model, instance_id, segment id) of a segment key."""
        parts = _tail(key, self.blocks_prefix()).split("/")
        tail = parts[-1]
        # Only the canonical form the writer produces: int(x, 16) alone takes "-0...1" and "0x".
        if (len(parts) != 3 or not _HASH_RE.fullmatch(tail)
                or not _INSTANCE_RE.match(parts[1])):
            raise MalformedKey(key, "not a block segment key: want {model}/{instance}/{segment}")
        try:
            model = validate_model(unquote(parts[0], errors="strict"))
        except ValueError as exc:  # UnicodeDecodeError included
            raise MalformedKey(key, f"bad model: {exc}") from None
        if quote(model, safe="") != parts[0]:
            # "%41" and "A" must not both be model "A": only the form segment() writes.
            raise MalformedKey(key, f"model {model!r} not quoted the way kvatlas writes it")
        return model, parts[1], int(tail, 16)

    def legacy_blocks_prefix(self) -> bytes:
        """Where kvatlas before the segment layout kept one key per block (read by nobody now;
        a mirror that finds keys there says so)."""
        return f"{self.root}blocks/".encode()

    # predictions: each router's recent routing decisions, a ring of slots under its lease
    def predictions_prefix(self, router_id: str | None = None) -> bytes:
        tail = f"{router_id}/" if router_id is not None else ""
        return f"{self.root}predictions/{tail}".encode()

    def prediction(self, router_id: str, slot: int) -> bytes:
        return f"{self.root}predictions/{router_id}/{slot:03d}".encode()

    def parse_prediction(self, key: bytes) -> str:
        """The router id of a prediction key."""
        parts = _tail(key, self.predictions_prefix()).split("/")
        if len(parts) != 2 or not parts[0] or not _SLOT_RE.fullmatch(parts[1]):
            raise MalformedKey(key, "not a prediction key: want {router_id}/{slot:03d}")
        return parts[0]


def _tail(key: bytes, prefix: bytes) -> str:
    """What follows ``prefix`` in ``key``, as text; MalformedKey when ``key`` is not under
    ``prefix`` or is not UTF-8 (etcd keys are any bytes: another tool may write those)."""
    if not isinstance(key, bytes) or not key.startswith(prefix):
        raise MalformedKey(key if isinstance(key, (bytes, str)) else repr(key),
                           f"not under {prefix.decode(errors='replace')}")
    try:
        return key[len(prefix):].decode()
    except UnicodeDecodeError:
        raise MalformedKey(key, "not UTF-8") from None
