"""The stored form of the block index: an instance's blocks grouped in chain segments.

One etcd key per segment, ``/{prefix}/v2/blocks/{model}/{instance_id}/{segment:016x}``, holding
a run of consecutive blocks of one chain (a prompt's blocks as the engine stored them, and the
blocks a decode appends after them), at most ``MAX_SEGMENT_BLOCKS``. A window's changes of one
instance then touch a few keys, not one key per block: etcd's cost is per key written, so this is
what lets one etcd carry several times more block changes (v1 wrote one key per block).

A block belongs to one segment while it is held; the writer (``index.writer``) never moves a held
block to another segment, and moves one that left only once its removal is in etcd, so a reader
applying each segment's new content in revision order (``index.mirror``) needs no per-block
bookkeeping of its own.

The value is self-describing: a 4-byte big-endian length, a msgpack header, then raw buffers::

    header: {"v": 2, "t": write time (unix s), "p": parent of the first block or None,
             "m": [medium names], "n": blocks}
    then:   n block hashes, little-endian uint64, in chain order
    then:   n medium indexes into "m", uint8 (absent when "m" has one name: every block on it)
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from index.errors import MalformedValue
from index.framing import finite_number, pack, strict_int, unpack

VERSION = 2
MAX_SEGMENT_BLOCKS = 64
"""Blocks per segment at most: a longer chain continues in a new segment (values stay under
~600 bytes, so a one-block change never rewrites much)."""
MAX_MEDIA = 255
_U64 = 2**64 - 1


class MalformedSegment(MalformedValue):
    """A value that is not a segment this version reads; ``reason`` names what is wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)


@dataclass(frozen=True)
class Segment:
    """One decoded segment value."""

    t: float
    """When it was written (unix seconds): the mirror's lag measure."""
    parent: int | None
    """The block before the segment's first one (None: it starts a chain)."""
    hashes: tuple[int, ...]
    media: tuple[str, ...]
    """Per block, its medium (``GPU``, ``CPU``, ...)."""

    def by_medium(self) -> dict[str, list[int]]:
        media = self.media
        if media and media.count(media[0]) == len(media):
            # One medium (the usual case: all on the GPU): no per-block loop in Python.
            return {media[0]: list(self.hashes)}
        out: dict[str, list[int]] = {}
        for h, m in zip(self.hashes, self.media, strict=True):
            out.setdefault(m, []).append(h)
        return out


def encode(t: float, parent: int | None, hashes: Sequence[int], media: Sequence[str]) -> bytes:
    """The value of a segment of ``hashes`` (chain order), block i on ``media[i]``."""
    if len(hashes) > MAX_SEGMENT_BLOCKS:
        # Readers refuse such a value (``decode``): never write one.
        raise ValueError(f"a segment holds at most {MAX_SEGMENT_BLOCKS} blocks, got {len(hashes)}")
    names: dict[str, int] = {}
    for m in media:
        if m not in names:
            names[m] = len(names)
    if len(names) > MAX_MEDIA:
        raise ValueError(f"a segment holds at most {MAX_MEDIA} media names, got {len(names)}")
    index = bytes(names[m] for m in media) if len(names) > 1 else b""
    return pack({"v": VERSION, "t": t, "p": parent, "m": list(names), "n": len(hashes)},
                struct.pack(f"<{len(hashes)}Q", *hashes), index)


def decode(raw: bytes) -> Segment:
    """The segment in ``raw``; MalformedSegment (with a reason) for anything else, and never
    another exception: the value comes from etcd, where any bytes can be."""
    header, body = unpack(raw, VERSION, MalformedSegment)
    t, parent, names, n = header.get("t"), header.get("p"), header.get("m"), header.get("n")
    # Strict types: a bool is an int to Python (``"n": true`` would size a buffer), and ``n``
    # past what a writer produces would let one value grow the index without bound.
    if not strict_int(n, 0, MAX_SEGMENT_BLOCKS):
        raise MalformedSegment("bad_count", f"n={str(n)[:40]}: want 0-{MAX_SEGMENT_BLOCKS} "
                                            "blocks")
    if (not finite_number(t) or not (parent is None or strict_int(parent, 0, _U64))
            or not isinstance(names, list) or len(names) > MAX_MEDIA or (n and not names)
            or not all(isinstance(m, str) for m in names)):
        raise MalformedSegment("bad_header", str(header)[:120])
    want = 8 * n + (n if len(names) > 1 else 0)
    if len(body) != want:
        raise MalformedSegment("bad_length", f"{len(body)} bytes for {n} blocks")
    hashes = struct.unpack_from(f"<{n}Q", body)
    if len(names) <= 1:
        media: tuple[str, ...] = (names[0],) * n if n else ()
    else:
        idx = bytes(body[8 * n:])
        if idx and max(idx) >= len(names):
            raise MalformedSegment("bad_medium", f"medium index {max(idx)} of {len(names)}")
        media = tuple(names[i] for i in idx)
    return Segment(float(t), parent, hashes, media)


def held_blocks(values: Iterable[bytes]) -> dict[int, str]:
    """Every block of these segment values, with its medium (values that are no segment are
    skipped): what an instance holds, read straight from its keys."""
    out: dict[int, str] = {}
    for raw in values:
        try:
            seg = decode(raw)
        except MalformedSegment:
            continue
        out.update(zip(seg.hashes, seg.media, strict=True))
    return out


def same_content(a: bytes, b: bytes | None) -> bool:
    """Whether two segment values hold the same blocks, media and parent (write times aside)."""
    if b is None:
        return False
    try:
        x, y = decode(a), decode(b)
    except MalformedSegment:
        return False
    return (x.parent, x.hashes, x.media) == (y.parent, y.hashes, y.media)
