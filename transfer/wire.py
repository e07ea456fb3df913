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

With a transfer key (``transfer.auth``), the header also carries ``auth`` and a nonce ``n``, and a
16-byte MAC over the header and the buffers follows as the last frame; it is checked before the
message is decoded any further. v2: the MAC, and the decode's pool size and chunk limit in
``register``. v3: the MAC also covers each buffer frame's length and their count.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import xxhash

from transfer import auth as _auth
from transfer.auth import TransferAuth
from transfer.base import TransferLayerError
from transfer.layout import KVLayout

WIRE_VERSION = 3
CHECKSUM_XXH3 = "xxh3_64"
#: Abort code: the prefill rank does not know this connection (it restarted); register again.
ABORT_UNREGISTERED = "unregistered"


class WireError(TransferLayerError, ValueError):
    """A message that cannot be decoded: wrong version, unknown kind, missing or bad field.

    ``kind`` and ``transfer_id`` are what the header claims, where it parsed: only to name the
    failure and to fail the transfer it names when it came from that transfer's own peer."""

    def __init__(self, message: str, head: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        head = head or {}
        self.kind, self.transfer_id = head.get("kind"), head.get("transfer_id")


class AuthError(WireError):
    """A message whose MAC is missing, unexpected or wrong; ``kind`` is what it claimed to be."""


#: Room for everything in a message besides its page bytes: header fields, a chunk's CUDA IPC
#: handles (about 200 bytes per layer and K/V), the MAC. Generous: it only has to stop frames
#: hundreds of MB larger than anything legitimate.
HEADER_ROOM = 1 << 20
#: Most bytes one page id takes in a msgpack request (a uint64).
PAGE_ID_BYTES = 9


def max_pages_message_bytes(layout: KVLayout, chunk_bytes: int) -> int:
    """The largest message a decode rank of ``layout`` accepts: a pages chunk holds at most
    ``chunk_bytes`` (its limit, sent in ``register``), or one page of one layer where that alone
    is larger (see ``plan_chunks``)."""
    one = layout.page_bytes((layout.layers[0], layout.layers[0] + 1))
    return max(chunk_bytes, one) + HEADER_ROOM


def max_request_message_bytes(num_pages: int) -> int:
    """The largest message a prefill rank whose pool has ``num_pages`` pages accepts: a request
    for all of them."""
    return num_pages * PAGE_ID_BYTES + HEADER_ROOM


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
    num_pages: int
    """Pages of the decode's pool: the prefill refuses requests for page ids outside it."""
    max_chunk_bytes: int
    """Largest pages payload the decode accepts in one message (its socket's size limit)."""
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


def encode(msg: Message, auth: TransferAuth | None = None, direction: str = _auth.P2D) -> list[Any]:
    """Frames of ``msg``: the packed header, then its buffers as given (not copied), then (with
    ``auth``) the MAC of ``direction`` over both."""
    head = msg.header()
    if auth is not None:
        head["auth"], head["n"] = _auth.ALGO, os.urandom(_auth.NONCE_BYTES)
    frames: list[Any] = [msgpack.packb(head, use_bin_type=True)]
    if isinstance(msg, Pages):
        frames.extend(msg.buffers)
    if auth is not None:
        frames.append(auth.tag(direction, frames[0], frames[1:]))
    return frames


def decode(frames: Sequence[Any], auth: TransferAuth | None = None,
           direction: str = _auth.P2D) -> Message:
    """Parse frames (bytes, memoryviews or anything with the buffer protocol) into a message.

    With ``auth``, the MAC of ``direction`` is checked on the raw frames before the header is
    parsed: the MAC needs no parsing (the one-time key is a PRF of the header's bytes), so a peer
    without the key cannot make this side build objects from its header (a msgpack array of one-byte
    ints costs 8 bytes of tuple per byte of frame). Without ``auth``, an authenticated message is
    refused too (the two sides' keys differ). Buffers of a ``pages`` message are kept as the
    objects given, so they stay zero-copy."""
    if not frames:
        raise WireError("empty message")
    if auth is not None:
        frames = _check_mac(frames, auth, direction)
    head = _parse_header(frames[0])
    algo = head.pop("auth", None)
    if auth is None and algo is not None:
        raise AuthError(f"{head.get('kind')} message is authenticated ({algo}) but this side has no "
                        "KV transfer key; set the same KVATLAS_TRANSFER_KEY on every prefill and "
                        "decode", head)
    if auth is not None and algo != _auth.ALGO:  # verified, so a key holder sent it: a bug
        raise WireError(f"{head.get('kind')} message verified but names MAC {algo!r}", head)
    try:
        return _build(head, frames)
    except WireError as e:
        e.kind, e.transfer_id = head.get("kind"), head.get("transfer_id")
        raise


def _build(head: dict[str, Any], frames: Sequence[Any]) -> Message:
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


def _parse_header(frame: Any) -> dict[str, Any]:
    try:
        head = msgpack.unpackb(frame, raw=False, use_list=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(head, dict):
        raise WireError(f"header must be a map, got {type(head).__name__}")
    version = head.get("v")
    if version != WIRE_VERSION:
        raise WireError(f"wire version mismatch: this side speaks v{WIRE_VERSION}, the message is "
                        f"v{version}; run the same kvatlas version on prefill and decode")
    return head


#: A header that failed its MAC is parsed, to name the failure, only up to this size (a legitimate
#: pages header without IPC handles is well under 1 KiB, a registration a few hundred bytes).
DIAGNOSE_HEADER_BYTES = 16 << 10


def _check_mac(frames: Sequence[Any], auth: TransferAuth, direction: str) -> Sequence[Any]:
    """The frames without the MAC, once it verified; else the reason, as precise as the
    (unauthenticated, so only parsed when small) header allows."""
    ok = (len(frames) >= 2 and memoryview(frames[-1]).nbytes == _auth.TAG_BYTES
          and auth.verify(direction, frames[0], frames[1:-1], frames[-1]))
    if ok:
        return frames[:-1]
    head: dict[str, Any] = {}
    if memoryview(frames[0]).nbytes <= DIAGNOSE_HEADER_BYTES:
        head = _parse_header(frames[0])  # a wrong version or no msgpack says so, as unkeyed
    kind, algo = head.get("kind"), head.get("auth")
    if head and algo is None:
        raise AuthError(f"{kind} message is not authenticated, but this side requires the KV "
                        "transfer key; set the same KVATLAS_TRANSFER_KEY on every prefill and "
                        "decode", head)
    if head and (algo != _auth.ALGO or len(frames) < 2
                 or memoryview(frames[-1]).nbytes != _auth.TAG_BYTES):
        raise AuthError(f"{kind} message has a bad MAC ({algo!r}, {len(frames) - 1} frames after "
                        "the header); run the same kvatlas version on prefill and decode", head)
    raise AuthError(f"{kind or 'a'} message failed its MAC check: it was not sent with this side's "
                    "KV transfer key (a different KVATLAS_TRANSFER_KEY, or a forged or altered "
                    "message)", head)


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


ROOM_RANGE = "[1, 2^64)"
"""The rooms the wire carries: a msgpack uint64, 0 left out. The room policy (SGLang's range)
is the callers' (``index/rooms.py``, which transfer may not import); this is only what the
data plane can hold, checked in one place."""


def is_room(v: Any) -> bool:
    """Whether ``v`` is a room the wire carries (ROOM_RANGE); a bool is not one."""
    return _is_int(v) and 0 < v < 2**64


def _check_pages(msg: Pages) -> None:
    # Types first: a string where an int belongs would otherwise raise TypeError deep in the
    # receiver, outside its error handling, and leave the room to its timeout.
    bad = [n for n in ("transfer_id", "room", "page_start", "page_count", "checksum")
           if not _is_int(getattr(msg, n))]
    bad += [n for n in ("dtype", "checksum_algo", "payload") if not isinstance(getattr(msg, n), str)]
    if not (isinstance(msg.shape, Sequence) and all(_is_int(x) for x in msg.shape)):
        bad.append("shape")
    if bad:
        raise WireError(f"pages message has fields of the wrong type: {', '.join(bad)}")
    for name in ("layers", "heads"):
        r = getattr(msg, name)
        if not isinstance(r, Sequence) or len(r) != 2 or not all(_is_int(x) for x in r) \
                or r[0] >= r[1]:
            raise WireError(f"pages message has a bad {name} range {r!r}")
    if msg.payload == "bytes" and len(msg.buffers) != msg.num_buffers:
        raise WireError(f"pages message for layers {tuple(msg.layers)} needs {msg.num_buffers} "
                        f"buffers (one per layer and K/V), got {len(msg.buffers)}")
    if msg.page_count < 1 or msg.page_start < 0:
        raise WireError(f"pages message has a bad page range start={msg.page_start} "
                        f"count={msg.page_count}")
