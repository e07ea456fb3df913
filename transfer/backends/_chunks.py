"""How a sender cuts one transfer into chunks, and small helpers of the sender's checks and hooks."""
from __future__ import annotations

from typing import Any

from transfer import wire


def plan_chunks(num_pages: int, layers: tuple[int, int], layer_page_bytes: int,
                chunk_bytes: int) -> list[tuple[tuple[int, int], int, int]]:
    """Split a transfer into (layer range, page start, page stop) chunks of about ``chunk_bytes``.

    Frames are whole (layer, K/V) planes of the selected pages, so a chunk groups layers when one
    layer is small (few frames, each large: ZMQ and the copies run at memory speed) and splits the
    pages of one layer when a layer alone exceeds ``chunk_bytes``. ``layer_page_bytes`` is one page
    of one layer, K and V."""
    layer_bytes = num_pages * layer_page_bytes
    out: list[tuple[tuple[int, int], int, int]] = []
    if layer_bytes >= chunk_bytes:
        per = max(1, chunk_bytes // layer_page_bytes)
        for layer in range(*layers):
            out.extend(((layer, layer + 1), p, min(p + per, num_pages))
                       for p in range(0, num_pages, per))
    else:
        per = max(1, chunk_bytes // layer_bytes)
        out.extend(((l0, min(l0 + per, layers[1])), 0, num_pages)
                   for l0 in range(layers[0], layers[1], per))
    return out


def check_room(room: int) -> None:
    if not wire.is_room(room):
        raise ValueError(f"bootstrap_room must be an integer in {wire.ROOM_RANGE}, got {room!r}")


def flip_first_byte(buf: Any) -> bytes:
    data = bytearray(buf)
    if data:
        data[0] ^= 0xFF
    return bytes(data)
