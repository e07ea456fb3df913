"""Authentication of data-plane messages with a key that prefill ranks and decode ranks share.

Without it, the room and checksum a decode checks are computed by the sender: any process that
reaches a transfer socket (or replaces a rank through the bootstrap table) could register, abort
rooms, and deliver KV that passes both checks. With a key (``KVATLAS_TRANSFER_KEY``, the same on
every prefill and decode of a cluster, distinct from the bootstrap token), every message carries a
MAC and a message whose MAC does not verify is dropped before anything acts on it.

Construction, per message:

- one key per direction, ``K_dir = BLAKE2b-256(key, person="kvatlas-" + dir)`` with ``dir`` ``p2d``
  (prefill to decode) or ``d2p``, so a captured message cannot be reflected back to its sender;
- the header (frame 0) carries ``auth: "poly1305"`` and a fresh random 16-byte nonce ``n``; the
  one-time Poly1305 key is ``BLAKE2b-256(header bytes, key=K_dir)``, a PRF of the whole header, so
  every header field (kind, room, transfer id, page range, layer/head box, checksum, IPC handles) is
  bound to the tag and no two messages share a one-time key;
- the tag, ``Poly1305(one-time key, b_1 || ... || b_n || le64(len b_1) ... le64(len b_n) ||
  le64(n))`` over the buffer frames in order, travels as the last frame. The trailer of lengths
  and count binds where each frame ends: without it, bytes could move from one frame to the next
  (or an empty frame be added) and the concatenation, hence the tag, would not change.

Poly1305 (OpenSSL, through ``cryptography``) runs at several GB/s on one core; a keyed BLAKE2b or
HMAC-SHA256 over the pages would cost more than the rest of the data plane together. The tag is
verified before the message is decoded any further, and it replaces the xxh3 checksum of a pages
chunk (a forgery-proof check subsumes a corruption check; one pass over the bytes, not two).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import struct
from collections.abc import Iterable
from typing import Any

from cryptography.hazmat.primitives.poly1305 import Poly1305

logger = logging.getLogger(__name__)

ALGO = "poly1305"
#: Directions: who sends. A key derived per direction keeps a message from being reflected.
P2D, D2P = "p2d", "d2p"
NONCE_BYTES = 16
TAG_BYTES = 16
MIN_KEY_CHARS = 16


class TransferAuth:
    """The shared transfer key of one sender or receiver: tags and checks messages."""

    def __init__(self, key: str) -> None:
        check_key(key)
        raw = key.encode()
        self._keys = {d: hashlib.blake2b(raw, digest_size=32, person=f"kvatlas-{d}".encode()).digest()
                      for d in (P2D, D2P)}

    @classmethod
    def from_key(cls, key: str | None) -> TransferAuth | None:
        return cls(key) if key is not None else None

    def tag(self, direction: str, header: bytes, buffers: Iterable[Any]) -> bytes:
        one_time = hashlib.blake2b(header, digest_size=32, key=self._keys[direction]).digest()
        mac = Poly1305(one_time)
        lengths = []
        for b in buffers:
            mac.update(b)  # buffer protocol: received frames and tensor views, never copied
            lengths.append(memoryview(b).nbytes)
        mac.update(struct.pack(f"<{len(lengths) + 1}Q", *lengths, len(lengths)))
        return mac.finalize()

    def verify(self, direction: str, header: bytes, buffers: Iterable[Any], tag: Any) -> bool:
        return hmac.compare_digest(self.tag(direction, header, buffers), bytes(tag))


def check_key(key: object) -> None:
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(f"the KV transfer key must be a string of at least {MIN_KEY_CHARS} "
                         "characters without whitespace (e.g. `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`), the same on every prefill and decode")
