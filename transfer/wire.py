"""The data-plane wire format: one msgpack header frame, then raw buffers.

Every message is a ZMQ multipart message (or the same list of frames in the fake backend):
frame 0 is a msgpack map ``{"v": WIRE_VERSION, "kind": ..., <fields>}``; ``pages`` messages are
followed by one raw frame per (layer, K/V), sent zero-copy from tensor storage. Headers are named
fields, never positional tails: unknown fields are ignored (newer peers may add some), missing ones
are an error naming the field, and a different ``v`` is refused with both versions named.

Kinds, and who sends them (P = prefill rank / sender, D = decode rank / receiver):
``register`` D->P once per connection (the decode's layout), ``register_ack`` P->D (the prefill's
layout or why it refuses), ``request`` D->P (room, transfer id, page ids to fill), ``pages`` P->D,
``final`` P->D (room, first output token, cached-token count), ``ack`` D->P (validated and
written), ``abort`` either way, ``heartbeat`` either way (``reply`` true on the answer).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import xxhash

from transfer.layout import KVLayout

WIRE_VERSION = 1
CHECKSUM_XXH3 = "xxh3_64"
#: Abort code: the prefill rank does not know this connection (it restarted); register again.
ABORT_UNREGISTERED = "unregistered"


class WireError(ValueError):
    """A message that cannot be decoded: wrong version, unknown kind, missing or bad field."""


def checksum(buffers: Iterable[Any]) -> int:
    """xxh3_64 over the concatenation of ``buffers``: exactly the bytes that go on the wire."""
    h = xxhash.xxh3_64()
    for b in buffers:
        h.update(b)
    return h.intdigest()


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""

    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": WIRE_VERSION, "kind": self.KIND}
        for f in dataclasses.fields(self):
            if f.name == "buffers":
                continue
            value = getattr(self, f.name)
            out[f.name] = value.to_wire() if isinstance(value, KVLayout) else value
        return out


@dataclass(frozen=True)
class Register(Message):
    KIND: ClassVar[str] = "register"
    receiver_id: str
    layout: KVLayout
    host_id: str = ""
    device: str = "cpu"


@dataclass(frozen=True)
class RegisterAck(Message):
    KIND: ClassVar[str] = "register_ack"
    ok: bool
    layout: KVLayout | None
    error: str = ""
    host_id: str = ""
    device: str = "cpu"


@dataclass(frozen=True)
class Request(Message):
    KIND: ClassVar[str] = "request"
    transfer_id: int
    room: int
    dst_rank: int
    num_requesters: int
    dst_page_ids: Sequence[int]


@dataclass(frozen=True)
class Pages(Message):
    KIND: ClassVar[str] = "pages"
    transfer_id: int
    room: int
    page_start: int
    page_count: int
    layers: Sequence[int]
    heads: Sequence[int]
    dtype: str
    shape: Sequence[int]
    checksum: int
    checksum_algo: str = CHECKSUM_XXH3
    payload: str = "bytes"
    packed: bool = False
    ipc: Sequence[Any] = ()
    buffers: Sequence[Any] = field(default=(), compare=False, repr=False)

    @property
    def num_buffers(self) -> int:
        return 2 * (self.layers[1] - self.layers[0])


@dataclass(frozen=True)
class Final(Message):
    KIND: ClassVar[str] = "final"
    transfer_id: int
    room: int
    first_token: int
    cached_tokens: int
    num_pages: int
    num_chunks: int


@dataclass(frozen=True)
class Ack(Message):
    KIND: ClassVar[str] = "ack"
    transfer_id: int
    room: int


@dataclass(frozen=True)
class Abort(Message):
    KIND: ClassVar[str] = "abort"
    room: int
    transfer_id: int | None
    reason: str
    code: str = ""
    """Machine-readable cause where the receiver must act on it (``ABORT_UNREGISTERED``)."""


@dataclass(frozen=True)
class Heartbeat(Message):
    KIND: ClassVar[str] = "heartbeat"
    seq: int
    reply: bool = False


KINDS: dict[str, type[Message]] = {c.KIND: c for c in (Register, RegisterAck, Request, Pages, Final,
                                                       Ack, Abort, Heartbeat)}


def encode(msg: Message) -> list[Any]:
    """Frames of ``msg``: the packed header, then its buffers as given (not copied)."""
    frames: list[Any] = [msgpack.packb(msg.header(), use_bin_type=True)]
    if isinstance(msg, Pages):
        frames.extend(msg.buffers)
    return frames


def decode(frames: Sequence[Any]) -> Message:
    """Parse frames (bytes, memoryviews or anything with the buffer protocol) into a message.

    Buffers of a ``pages`` message are kept as the objects given, so they stay zero-copy."""
    if not frames:
        raise WireError("empty message")
    try:
        head = msgpack.unpackb(frames[0], raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(head, dict):
        raise WireError(f"header must be a map, got {type(head).__name__}")
    version = head.get("v")
    if version != WIRE_VERSION:
        raise WireError(f"wire version mismatch: this side speaks v{WIRE_VERSION}, the message is "
                        f"v{version}; run the same kvatlas version on prefill and decode")
    cls = KINDS.get(head.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise WireError(f"unknown message kind {head.get('kind')!r}; expected one of {sorted(KINDS)}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "buffers":
            continue
        if f.name in head:
            kwargs[f.name] = head[f.name]
        elif f.default is dataclasses.MISSING:
            raise WireError(f"{cls.KIND} message is missing field {f.name!r}")
    if "layout" in kwargs and kwargs["layout"] is not None:
        try:
            kwargs["layout"] = KVLayout.from_wire(dict(kwargs["layout"]))
        except (ValueError, TypeError) as e:
            raise WireError(f"{cls.KIND} message has a bad layout: {e}") from None
    if cls is Pages:
        kwargs["buffers"] = tuple(frames[1:])
        if kwargs.get("packed"):
            kwargs["buffers"] = _unpack(kwargs, frames[1:])
        msg = Pages(**kwargs)
        _check_pages(msg)
        return msg
    if len(frames) != 1:
        raise WireError(f"{cls.KIND} message carries {len(frames) - 1} unexpected buffer frames")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise WireError(f"bad {cls.KIND} message: {e}") from None


def _unpack(kwargs: dict[str, Any], frames: Sequence[Any]) -> tuple[memoryview, ...]:
    """Split the single frame of a packed message into its equal-sized buffers (views)."""
    layers = kwargs.get("layers") or (0, 0)
    n = 2 * (layers[1] - layers[0]) if len(layers) == 2 else 0
    if len(frames) != 1 or n < 1:
        raise WireError(f"packed pages message needs exactly one frame, got {len(frames)}")
    view = memoryview(frames[0]).cast("B")
    if len(view) % n:
        raise WireError(f"packed frame of {len(view)} bytes does not split into {n} buffers")
    size = len(view) // n
    return tuple(view[i * size:(i + 1) * size] for i in range(n))


def pack(buffers: Sequence[Any]) -> bytes:
    """Concatenate small buffers into one frame: the bytes (and their checksum) are unchanged,
    but one frame costs one send instead of one per (layer, K/V)."""
    return b"".join(buffers)


def _check_pages(msg: Pages) -> None:
    for name in ("layers", "heads"):
        r = getattr(msg, name)
        if len(r) != 2 or not all(isinstance(x, int) for x in r) or r[0] >= r[1]:
            raise WireError(f"pages message has a bad {name} range {r!r}")
    if msg.payload == "bytes" and len(msg.buffers) != msg.num_buffers:
        raise WireError(f"pages message for layers {tuple(msg.layers)} needs {msg.num_buffers} "
                        f"buffers (one per layer and K/V), got {len(msg.buffers)}")
    if msg.page_count < 1 or msg.page_start < 0:
        raise WireError(f"pages message has a bad page range start={msg.page_start} "
                        f"count={msg.page_count}")
