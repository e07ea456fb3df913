"""Paged KV pool: one real tensor ``[layers, 2 (k/v), pages, page_size, kv_heads, head_dim]``.

A page holds the K and V of ``page_size`` consecutive positions of one sequence in every layer;
a sequence's page table lists its pages in position order, so position ``p`` lives in page
``table[p // page_size]`` at slot ``p % page_size``. The pool only counts references and keeps
the free list; which pages are cached (and when they may be evicted) is the prefix cache's job.

The pool may hold a subset of the model's KV heads (``kv_heads``: the range a tensor-parallel rank
owns); pages can be copied out and in by page id (``read_pages``/``write_pages``), which is what
a disaggregated transfer moves.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from engine.errors import PoolExhausted


class KVPool:
    """Fixed-capacity page pool with reference counts."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 num_pages: int, page_size: int = 16, device: str | torch.device = "cpu",
                 kv_heads: range | None = None) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"pool needs num_pages >= 1 and page_size >= 1, got "
                             f"{num_pages} pages of {page_size}")
        self.kv_heads = kv_heads if kv_heads is not None else range(num_kv_heads)
        if not self.kv_heads or self.kv_heads.start < 0 or self.kv_heads.stop > num_kv_heads:
            raise ValueError(f"kv_heads {self.kv_heads} outside 0..{num_kv_heads}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.head_dim = head_dim
        self.dtype = dtype
        self.kv = torch.zeros(num_layers, 2, num_pages, page_size, len(self.kv_heads), head_dim,
                              dtype=dtype, device=device)
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages
        self.unreferenced = 0
        """Times a page lost its last reference, ever: it then became free or evictable, so a
        caller waiting for pages compares this count before and after (``AsyncEngine``)."""

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_page(self) -> int:
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def refcount(self, page: int) -> int:
        return self._refs[page]

    @property
    def total_refs(self) -> int:
        """References held over all pages: 0 at rest, whatever was cached (a cached page no
        request uses has none), so a leak shows here even when the free list looks fine."""
        return sum(self._refs)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, each with one reference; raises PoolExhausted."""
        if n > len(self._free):
            raise PoolExhausted(needed=n, free=len(self._free), capacity=self.num_pages)
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, page: int) -> None:
        self._refs[page] += 1

    def decref(self, page: int) -> int:
        """Drop one reference; returns the remaining count (the caller decides what 0 means)."""
        if self._refs[page] <= 0:
            raise RuntimeError(f"page {page} released more often than referenced")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self.unreferenced += 1
        return self._refs[page]

    def release(self, page: int) -> None:
        """Return an unreferenced page to the free list."""
        if self._refs[page] != 0:
            raise RuntimeError(f"page {page} freed with {self._refs[page]} references")
        self._free.append(page)

    # -- data ------------------------------------------------------------------------------
    def slots(self, table: Sequence[int], start: int, n: int) -> torch.Tensor:
        """Flat slot ids (page * page_size + offset) of positions ``start .. start + n - 1``."""
        pos = torch.arange(start, start + n)
        pages = torch.as_tensor(list(table), dtype=torch.long)[pos // self.page_size]
        return pages * self.page_size + pos % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[n, kv_heads, head_dim]`` at flat ``slots``."""
        flat = self.kv[layer].view(2, self.num_pages * self.page_size, len(self.kv_heads),
                                   self.head_dim)
        flat[0, slots] = k
        flat[1, slots] = v

    def gather(self, layer: int, table: Sequence[int], length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, kv_heads, head_dim]`` of positions ``0 .. length - 1``."""
        n_pages = -(-length // self.page_size)
        idx = torch.as_tensor(list(table[:n_pages]), dtype=torch.long)
        kv = self.kv[layer][:, idx].reshape(2, n_pages * self.page_size, len(self.kv_heads),
                                            self.head_dim)
        return kv[0, :length], kv[1, :length]

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A copy ``[layers, 2, len(pages), page_size, kv_heads, head_dim]`` of ``pages``."""
        return self.kv[:, :, torch.as_tensor(list(pages), dtype=torch.long)].clone()

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite ``pages`` with ``data`` shaped as ``read_pages`` returns."""
        expect = (self.num_layers, 2, len(pages), self.page_size, len(self.kv_heads), self.head_dim)
        if tuple(data.shape) != expect or data.dtype != self.dtype:
            raise ValueError(f"page data {tuple(data.shape)} {data.dtype} does not match the "
                             f"pool's {expect} {self.dtype}")
        self.kv[:, :, torch.as_tensor(list(pages), dtype=torch.long)] = data.to(self.kv.device)
