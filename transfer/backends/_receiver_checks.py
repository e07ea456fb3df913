"""The decode's checks of a room's peers and chunks, apart from the protocol that runs them."""
from __future__ import annotations

from dataclasses import dataclass

from transfer import wire
from transfer.base import TransferError
from transfer.layout import KVLayout


@dataclass
class PeerRx:
    layers: tuple[int, int]
    heads: tuple[int, int]
    covered: bytearray
    first_ok: bool = False
    chunks: int = 0
    """Chunks of this peer that passed every check."""
    final: wire.Final | None = None


def chunk_problems(layout: KVLayout, p: PeerRx, n: int, msg: wire.Pages,
                   want_shape: tuple[int, ...]) -> list[str]:
    """What is wrong with a pages chunk from one peer, whose room already matched: dtype, layer
    and head box, page range within the ``n`` reserved pages (each cell once), shape."""
    end = msg.page_start + msg.page_count
    problems = []
    if msg.dtype != layout.dtype:
        problems.append(f"kv_cache_dtype {msg.dtype!r}, expected {layout.dtype!r}")
    l0, l1 = msg.layers
    if not p.layers[0] <= l0 < l1 <= p.layers[1] or tuple(msg.heads) != p.heads:
        problems.append(f"box layers {tuple(msg.layers)} heads {tuple(msg.heads)}, expected "
                        f"layers within {p.layers} and heads {p.heads}")
    elif end > n or any(any(p.covered[(l - p.layers[0]) * n + msg.page_start:
                                      (l - p.layers[0]) * n + end]) for l in range(l0, l1)):
        problems.append(f"pages [{msg.page_start}, {end}) of layers [{l0}, {l1}) outside "
                        f"[0, {n}) or sent twice")
    if tuple(msg.shape) != want_shape:
        problems.append(f"shape {tuple(msg.shape)}, expected {want_shape}")
    return problems


def requesters(mine: KVLayout, theirs: KVLayout | None) -> int:
    """How many decode ranks read one prefill rank (SGLang's required_dst_info_num)."""
    if theirs is None or mine.tp_size <= theirs.tp_size:
        return 1
    return mine.tp_size // theirs.tp_size


def check_coverage(room: int, layout: KVLayout, peers: dict[str, PeerRx]) -> None:
    cells: set[tuple[int, int]] = set()
    for endpoint, p in peers.items():
        box = {(l, h) for l in range(*p.layers) for h in range(*p.heads)}
        if cells & box:
            raise TransferError(room, f"prefill ranks overlap at layers {p.layers} heads {p.heads} "
                                f"({endpoint}); check the rank mapping", peer=endpoint)
        cells |= box
    need = layout.local_layers * layout.local_heads
    if len(cells) != need:
        raise TransferError(room, f"the prefill ranks {list(peers)} cover {len(cells)} of the "
                            f"{need} (layer, head) cells of layers {layout.layers} heads "
                            f"{layout.heads}; the rank mapping left some out")
