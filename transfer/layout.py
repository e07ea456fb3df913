"""KV buffer layouts, the page-source interface of a prefill rank, and tensor <-> byte views.

A rank's KV pool is one tensor ``[layers, 2, pages, page_size, heads, head_dim]`` (local layers and
heads only). ``KVLayout`` says which slice of the model's KV that tensor holds: a layer range (PP)
and a head range (TP). When prefill and decode TP sizes differ, each prefill rank sends the
intersection of its box with the decode rank's box, so D < P gathers head shards from several
prefill ranks and D > P splits one prefill rank's heads across several decode ranks.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

#: dtypes a KV pool may have, by the name used on the wire (``str(torch.dtype)`` minus "torch.").
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                 "int8", "uint8")
    if hasattr(torch, name)
}

Range = tuple[int, int]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"KV dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class KVLayout:
    """The slice of a model's paged KV one rank holds, and its page geometry."""

    num_layers: int
    """Layers of the whole model."""
    num_heads: int
    """KV heads of the whole model."""
    head_dim: int
    page_size: int
    """Tokens per page."""
    dtype: str
    """Wire name of the KV dtype (``bfloat16``, ``float32``, ...)."""
    layers: Range
    """[start, end) of the layers this rank holds."""
    heads: Range
    """[start, end) of the KV heads this rank holds."""
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "head_dim", "page_size", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        dtype_from_name(self.dtype)
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "heads", tuple(self.heads))
        for name, total in (("layers", self.num_layers), ("heads", self.num_heads)):
            lo, hi = getattr(self, name)
            if not 0 <= lo < hi <= total:
                raise ValueError(f"KVLayout.{name} must be a non-empty range inside [0, {total}), "
                                 f"got [{lo}, {hi})")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")

    @classmethod
    def for_tp(cls, *, num_layers: int, num_heads: int, head_dim: int, page_size: int,
               dtype: str | torch.dtype, tp_rank: int = 0, tp_size: int = 1,
               layers: Range | None = None) -> KVLayout:
        """The layout of TP rank ``tp_rank`` of ``tp_size`` when KV heads are split evenly."""
        if tp_size < 1 or num_heads % tp_size:
            raise ValueError(f"{num_heads} KV heads cannot be split evenly over tp_size {tp_size}; "
                             "pick a TP size that divides the number of KV heads")
        per = num_heads // tp_size
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        return cls(num_layers=num_layers, num_heads=num_heads, head_dim=head_dim,
                   page_size=page_size, dtype=name, layers=layers or (0, num_layers),
                   heads=(tp_rank * per, (tp_rank + 1) * per), tp_rank=tp_rank, tp_size=tp_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def local_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def local_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.local_layers, 2, num_pages, self.page_size, self.local_heads, self.head_dim)

    def page_bytes(self, layers: Range | None = None, heads: Range | None = None) -> int:
        """Bytes of one page over ``layers`` x ``heads`` (default: this rank's own box), K and V."""
        nl = (layers or self.layers)[1] - (layers or self.layers)[0]
        nh = (heads or self.heads)[1] - (heads or self.heads)[0]
        return nl * 2 * self.page_size * nh * self.head_dim * self.torch_dtype.itemsize

    def mismatches(self, other: KVLayout) -> list[str]:
        """Model-wide geometry that must agree between a prefill and a decode, naming both values."""
        out = []
        for name in ("page_size", "dtype", "num_layers", "num_heads", "head_dim"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                label = "kv_cache_dtype" if name == "dtype" else name
                out.append(f"{label}: this side {mine!r}, peer {theirs!r}")
        return out

    def check_pool(self, pool: torch.Tensor, what: str = "pool") -> None:
        if pool.dim() != 6 or tuple(pool.shape[:2]) != (self.local_layers, 2) or tuple(
                pool.shape[3:]) != (self.page_size, self.local_heads, self.head_dim):
            raise ValueError(f"{what} has shape {tuple(pool.shape)}, but the layout needs "
                             f"{self.pool_shape(-1)} ([layers, 2, pages, page_size, heads, "
                             "head_dim] with pages free)")
        if pool.dtype != self.torch_dtype:
            raise ValueError(f"{what} dtype is {pool.dtype}, the layout says {self.dtype}")

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"], d["heads"] = list(self.layers), list(self.heads)
        return d

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> KVLayout:
        names = ("num_layers", "num_heads", "head_dim", "page_size", "dtype", "layers", "heads",
                 "tp_rank", "tp_size")
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"layout is missing {missing}")
        return cls(**{n: d[n] for n in names})


class PageSource(Protocol):
    """What a sender reads KV from: returns, for the given pool page ids, one tensor per
    (layer, K/V) over ``layers`` x ``heads`` (global ranges), ordered layer-major, each shaped
    ``[len(page_ids), page_size, heads, head_dim]`` and contiguous. The tensors must stay unchanged
    until the transfer succeeds or fails (the sender keeps references and may send zero-copy)."""

    @property
    def num_pages(self) -> int:
        """Pages of the pool: no room's KV is longer, so a decode asking for more is refused."""
        ...

    def read_pages(self, page_ids: Sequence[int], layers: Range, heads: Range) -> list[torch.Tensor]:
        ...


def _run(page_ids: Sequence[int]) -> tuple[int, int] | None:
    """(start, stop) when ``page_ids`` is one ascending run of consecutive ids."""
    if len(page_ids) and page_ids[-1] - page_ids[0] == len(page_ids) - 1 and all(
            b - a == 1 for a, b in zip(page_ids, page_ids[1:])):
        return page_ids[0], page_ids[-1] + 1
    return None


class TensorPageSource:
    """A :class:`PageSource` over a pool tensor ``[layers, 2, pages, page_size, heads, head_dim]``.

    Consecutive page ids over the full local head range are returned as views (zero-copy); other
    selections are gathered into new contiguous tensors, one per (layer, K/V).
    """

    def __init__(self, pool: torch.Tensor, layout: KVLayout) -> None:
        layout.check_pool(pool, "prefill KV pool")
        self.pool, self.layout = pool, layout

    @property
    def num_pages(self) -> int:
        return int(self.pool.shape[2])

    def read_pages(self, page_ids: Sequence[int], layers: Range, heads: Range) -> list[torch.Tensor]:
        lay = self.layout
        if intersect(layers, lay.layers) != tuple(layers) or intersect(heads, lay.heads) != tuple(heads):
            raise ValueError(f"asked for layers {layers} heads {heads}, this pool holds layers "
                             f"{lay.layers} heads {lay.heads}")
        pages = self.pool.shape[2]
        if not len(page_ids) or min(page_ids) < 0 or max(page_ids) >= pages:
            raise ValueError(f"page ids must be a non-empty list within [0, {pages}) of this pool, "
                             f"got {len(page_ids)} ids from {min(page_ids, default=None)} to "
                             f"{max(page_ids, default=None)}")
        h0, h1 = heads[0] - lay.heads[0], heads[1] - lay.heads[0]
        full_heads = (h0, h1) == (0, lay.local_heads)
        run = _run(list(page_ids))
        on_cpu = self.pool.device.type == "cpu"
        index: Any = None
        if not run:
            index = (np.asarray(page_ids, dtype=np.int64) if on_cpu else
                     torch.as_tensor(list(page_ids), dtype=torch.long, device=self.pool.device))
        out = []
        for layer in range(layers[0] - lay.layers[0], layers[1] - lay.layers[0]):
            for kv in (0, 1):
                plane = self.pool[layer, kv]
                if run:
                    sel = plane[run[0]:run[1]]
                    if not full_heads:
                        sel = sel[:, :, h0:h1]
                    if sel.is_contiguous():
                        out.append(sel)
                        continue
                if on_cpu:  # gather on this thread (see numpy_view)
                    arr = numpy_view(plane)
                    arr = arr[run[0]:run[1]] if run else arr.take(index, axis=0)
                    arr = np.ascontiguousarray(arr[:, :, h0:h1])
                    out.append(torch.from_numpy(arr).view(plane.dtype))
                else:
                    sel = plane[run[0]:run[1]] if run else plane.index_select(0, index)
                    out.append(sel[:, :, h0:h1].contiguous())
        return out


_INT_OF_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """The same memory as a numpy array of same-sized integers (numpy has no bf16/fp8).

    CPU copies of the data plane go through numpy on purpose: torch splits large copies over its
    OpenMP pool, whose spinning threads fight the ZMQ I/O threads for the cores and made pool
    writes ~10x slower on a 2-core host; numpy copies on the calling thread only."""
    if t.device.type != "cpu":
        raise ValueError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    return t.view(_torch_int(t.element_size())).numpy()


def _torch_int(size: int) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor, sharing its storage (no copy).

    bf16 and the float8 types have no numpy equivalent, so the view goes through uint8."""
    if t.device.type != "cpu":
        raise ValueError(f"tensor_bytes needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def bytes_array(buf: Any, dtype: torch.dtype, shape: Sequence[int]) -> np.ndarray:
    """A read-only numpy view over ``buf`` holding ``dtype`` elements as same-sized integers."""
    return np.frombuffer(buf, dtype=_INT_OF_SIZE[dtype.itemsize]).reshape(tuple(shape))


def array_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The torch tensor (``dtype``) over an integer array from :func:`bytes_array`, no copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": it is only read
        return torch.from_numpy(arr).view(dtype)


def bytes_tensor(buf: Any, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor over ``buf`` (any buffer, e.g. a received ZMQ frame) without copying.

    The buffer may be read-only; the tensor must then only be read (it is copied into the pool)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": we only read it
        t = torch.from_numpy(arr)
    return t.view(dtype).view(tuple(shape))
