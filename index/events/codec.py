"""The vLLM/SGLang KV-event wire format: three ZMQ frames ``[topic, seq, payload]``.

``seq`` is 8 bytes big-endian unsigned; ``payload`` is a msgpack ``KVEventBatch``
``[ts, events, data_parallel_rank?]`` (an array of 2 or 3 elements; a map with those names is
accepted too). Events come in two encodings and both are decoded:

- array form: ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, ...]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``; trailing defaulted fields may be missing, extra trailing ones are
  ignored;
- map form: ``{"type": "BlockStored", "block_hashes": [...], ...}``; unknown keys are ignored.

``extra_keys`` (per-block extra hash inputs: multimodal content hashes, salts) is decoded as given
(an array or null) so that the ingestor can refuse such blocks; ``medium`` is any string here, the
ingestor refuses what the index cannot store.

Engine hashes (int64, uint64 or bytes whose last 8 bytes are big-endian) are normalised to
unsigned 64-bit ints. Anything else raises ``MalformedEvent`` with a stable reason label. Event
types we do not know are skipped (a newer engine may add some) rather than failing the batch.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import numpy as np

from index.events.errors import MalformedEvent
from index.events.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch

logger = logging.getLogger(__name__)

U64 = 2**64 - 1
MAX_TOKEN_ID = 2**32 - 1
_SMALL_TOKENS = 256
"""Up to this many token ids are checked without numpy (its per-call cost dominates)."""
END_SEQ = b"\xff" * 8  # replay end marker: seq -1
Encoding = Literal["map", "array"]


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds that keep one hostile or broken message from using unbounded memory or time."""

    max_payload_bytes: int = 64 * 2**20
    """Payloads larger than this are refused before msgpack sees them."""
    max_tokens_per_event: int = 1 << 20
    """A BlockStored with more token ids than this is refused (vLLM sends at most one prompt)."""
    max_hashes_per_event: int = 1 << 16
    """A BlockStored/BlockRemoved with more block hashes than this is refused."""
    max_events_per_batch: int = 1 << 16


DEFAULT_LIMITS = DecodeLimits()


# -- decoding ------------------------------------------------------------------------------------

def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise MalformedEvent("bad_seq", f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_message(frames: Sequence[bytes],
                   limits: DecodeLimits = DEFAULT_LIMITS) -> tuple[bytes, int, KVEventBatch]:
    """``[topic, seq, payload]`` -> ``(topic, seq, batch)``."""
    if len(frames) != 3:
        raise MalformedEvent("frame_count", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_frame, payload = (bytes(f) for f in frames)
    return topic, decode_seq(seq_frame), decode_payload(payload, limits)


def decode_payload(payload: bytes, limits: DecodeLimits = DEFAULT_LIMITS) -> KVEventBatch:
    if len(payload) > limits.max_payload_bytes:
        raise MalformedEvent("too_large", f"payload of {len(payload)} bytes exceeds "
                             f"{limits.max_payload_bytes}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise MalformedEvent("bad_msgpack", f"{type(exc).__name__}: {exc}") from None
    return decode_batch(obj, limits)


def decode_batch(obj: Any, limits: DecodeLimits = DEFAULT_LIMITS) -> KVEventBatch:
    if isinstance(obj, dict):
        if "events" not in obj:
            raise MalformedEvent("bad_batch", "batch map has no 'events'")
        ts, events, dp = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    elif isinstance(obj, list):
        if len(obj) not in (2, 3):
            raise MalformedEvent("bad_batch", f"batch array must have 2 or 3 elements, got {len(obj)}")
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) == 3 else None
    else:
        raise MalformedEvent("bad_batch", f"batch must be an array or map, got {type(obj).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise MalformedEvent("bad_batch", f"ts must be a finite number, got {ts!r:.40}")
    if not isinstance(events, list):
        raise MalformedEvent("bad_batch", f"events must be an array, got {type(events).__name__}")
    if len(events) > limits.max_events_per_batch:
        raise MalformedEvent("too_large", f"{len(events)} events in one batch")
    if dp is not None and (isinstance(dp, bool) or not isinstance(dp, int) or dp < 0):
        raise MalformedEvent("bad_batch", f"data_parallel_rank must be a non-negative int, got {dp!r:.40}")
    out: list[KVEvent] = []
    for ev in events:
        decoded = decode_event(ev, limits)
        if decoded is not None:
            out.append(decoded)
    return KVEventBatch(float(ts), out, dp)


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")
_STORED_REQUIRED = 4
_REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(ev: Any, names: tuple[str, ...], required: int) -> dict[str, Any]:
    if isinstance(ev, list):
        vals = ev[1:]
        if len(vals) < required:
            raise MalformedEvent("missing_field", f"{ev[0]} has {len(vals)} fields, needs {required}")
        return {n: (vals[i] if i < len(vals) else None) for i, n in enumerate(names)}
    missing = [n for n in names[:required] if n not in ev]
    if missing:
        raise MalformedEvent("missing_field", f"{ev.get('type')} lacks {', '.join(missing)}")
    return {n: ev.get(n) for n in names}


def decode_event(ev: Any, limits: DecodeLimits = DEFAULT_LIMITS) -> KVEvent | None:
    """One tagged event; None for an event type this version does not know."""
    if isinstance(ev, list) and ev:
        tag = ev[0]
    elif isinstance(ev, dict):
        tag = ev.get("type")
    else:
        raise MalformedEvent("bad_event", f"event must be a tagged array or map, got {ev!r:.60}")
    if tag == "BlockStored":
        f = _fields(ev, _STORED_FIELDS, _STORED_REQUIRED)
        return BlockStored(
            block_hashes=_hashes(f["block_hashes"], limits),
            parent_block_hash=None if f["parent_block_hash"] is None else _hash(f["parent_block_hash"]),
            token_ids=_tokens(f["token_ids"], limits),
            block_size=_pos_int(f["block_size"], "block_size"),
            lora_id=_opt_int(f["lora_id"], "lora_id"),
            medium=_opt_str(f["medium"], "medium"),
            lora_name=_opt_str(f["lora_name"], "lora_name"),
            extra_keys=_extra_keys(f["extra_keys"]),
        )
    if tag == "BlockRemoved":
        f = _fields(ev, _REMOVED_FIELDS, 1)
        return BlockRemoved(_hashes(f["block_hashes"], limits), _opt_str(f["medium"], "medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise MalformedEvent("bad_event", f"event tag must be a string, got {tag!r:.40}")
    logger.debug("skipping KV event of unknown type %r", tag)
    return None


def _hash(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        if -(2**63) <= v <= U64:
            return v & U64
        raise MalformedEvent("bad_hash", f"block hash {v} is outside the 64-bit range")
    if isinstance(v, (bytes, bytearray)):
        if not v:
            raise MalformedEvent("bad_hash", "empty bytes block hash")
        return int.from_bytes(v[-8:], "big")
    raise MalformedEvent("bad_hash", f"block hash must be an int or bytes, got {type(v).__name__}")


def _hashes(v: Any, limits: DecodeLimits) -> list[int]:
    if not isinstance(v, list):
        raise MalformedEvent("bad_hash", f"block_hashes must be an array, got {type(v).__name__}")
    if len(v) > limits.max_hashes_per_event:
        raise MalformedEvent("too_large", f"{len(v)} block hashes in one event")
    return [_hash(h) for h in v]


def _tokens(v: Any, limits: DecodeLimits) -> list[int]:
    if not isinstance(v, list):
        raise MalformedEvent("bad_tokens", f"token_ids must be an array, got {type(v).__name__}")
    if len(v) > limits.max_tokens_per_event:
        raise MalformedEvent("too_large", f"{len(v)} token ids in one event exceed "
                             f"{limits.max_tokens_per_event}")
    if not v:
        return v
    if len(v) <= _SMALL_TOKENS:
        # A page or a few (every one-block event): plain Python is several times faster than
        # building an array, and a burst of such events is decoded one by one.
        if not all(type(t) is int for t in v):
            raise MalformedEvent("bad_tokens", "token_ids must be integers")
        if min(v) < 0 or max(v) > MAX_TOKEN_ID:
            raise MalformedEvent("bad_tokens", "token ids must be in the uint32 range")
        return v
    try:
        arr = np.asarray(v)
    except (ValueError, OverflowError, TypeError):
        raise MalformedEvent("bad_tokens", "token_ids is not a flat array of integers") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise MalformedEvent("bad_tokens", "token_ids must be integers")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise MalformedEvent("bad_tokens", "token ids must be in the uint32 range")
    return v


def _pos_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise MalformedEvent("bad_field", f"{name} must be a positive int, got {v!r:.40}")
    return v


def _opt_int(v: Any, name: str) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise MalformedEvent("bad_field", f"{name} must be an int or null, got {v!r:.40}")
    return v


def _opt_str(v: Any, name: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise MalformedEvent("bad_field", f"{name} must be a string or null, got {v!r:.40}")
    return v


def _extra_keys(v: Any) -> list[Any] | None:
    # Kept as given: the ingestor only needs to know whether any block carries extra hash inputs.
    if v is not None and not isinstance(v, list):
        raise MalformedEvent("bad_field", f"extra_keys must be an array or null, got {v!r:.40}")
    return v


# -- encoding ------------------------------------------------------------------------------------

def encode_event(ev: KVEvent, encoding: Encoding = "map") -> Any:
    if isinstance(ev, BlockStored):
        vals = [list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), ev.block_size,
                ev.lora_id, ev.medium, ev.lora_name, ev.extra_keys]
        return _shape("BlockStored", _STORED_FIELDS, vals, _STORED_REQUIRED, encoding)
    if isinstance(ev, BlockRemoved):
        return _shape("BlockRemoved", _REMOVED_FIELDS, [list(ev.block_hashes), ev.medium], 1, encoding)
    if isinstance(ev, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def _shape(tag: str, names: tuple[str, ...], vals: list[Any], required: int,
           encoding: Encoding) -> Any:
    if encoding == "map":
        # Defaulted (None) optional fields are left out, as vLLM does.
        out: dict[str, Any] = {"type": tag}
        for i, (n, v) in enumerate(zip(names, vals)):
            if v is not None or i < required:
                out[n] = v
        return out
    if encoding != "array":
        raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
    while len(vals) > required and vals[-1] is None:
        vals.pop()
    return [tag, *vals]


def encode_payload(batch: KVEventBatch, encoding: Encoding = "map") -> bytes:
    body = [batch.ts, [encode_event(e, encoding) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def encode_message(topic: bytes, seq: int, batch: KVEventBatch,
                   encoding: Encoding = "map") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), encode_payload(batch, encoding)]
