"""Copying validated chunks into a decode rank's pool ``[layers, 2, pages, page_size, heads, hd]``."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from transfer.layout import KVLayout, Range, array_tensor, numpy_view


class PoolWriter:
    """Writes one chunk (one tensor per layer and K/V) into pool pages over a layer/head box.

    A host pool is written through numpy on the calling thread (see ``layout.numpy_view``); a GPU
    pool with torch copies on the current stream, waited for by ``synchronize()``."""

    def __init__(self, pool: torch.Tensor, layout: KVLayout) -> None:
        self.pool, self.layout = pool, layout
        self._async = pool.device.type == "cuda"
        self._np = numpy_view(pool) if pool.device.type == "cpu" else None

    def write(self, page_ids: Sequence[int], layers: Range, heads: Range,
              tensors: Sequence[Any]) -> None:
        """``tensors``: one per (layer, K/V), torch tensors or numpy integer views (received
        bytes), each ``[pages, page_size, heads, head_dim]``."""
        lay = self.layout
        h0, h1 = heads[0] - lay.heads[0], heads[1] - lay.heads[0]
        full = (h0, h1) == (0, lay.local_heads)
        ids = list(page_ids)
        run = (ids[0], ids[-1] + 1) if ids[-1] - ids[0] == len(ids) - 1 and all(
            b - a == 1 for a, b in zip(ids, ids[1:])) else None
        if self._np is not None:
            index: object = slice(*run) if run else np.asarray(ids, dtype=np.int64)
        else:
            index = slice(*run) if run else torch.as_tensor(ids, dtype=torch.long,
                                                            device=self.pool.device)
        i = 0
        for layer in range(layers[0] - lay.layers[0], layers[1] - lay.layers[0]):
            for kv in (0, 1):
                src = tensors[i]
                i += 1
                if self._np is not None:
                    arr = src if isinstance(src, np.ndarray) else (
                        numpy_view(src) if src.device.type == "cpu" else None)
                    if arr is not None:
                        plane = self._np[layer, kv]
                        if full:
                            plane[index] = arr
                        else:
                            plane[index, :, h0:h1] = arr
                        continue
                if isinstance(src, np.ndarray):
                    src = array_tensor(src, self.pool.dtype)
                if src.device != self.pool.device:
                    src = src.to(self.pool.device, non_blocking=self._async)
                plane_t = self.pool[layer, kv]
                if run:
                    dst = plane_t[run[0]:run[1]]
                    (dst if full else dst[:, :, h0:h1]).copy_(src, non_blocking=self._async)
                elif full:
                    plane_t.index_copy_(0, index, src)  # type: ignore[arg-type]
                else:
                    plane_t[index, :, h0:h1] = src
        if self._async:
            # The sources (received frames, another process's IPC memory) may be released as soon
            # as this returns, so the copies must be done by then.
            torch.cuda.current_stream(self.pool.device).synchronize()

    def synchronize(self) -> None:
        """Wait for asynchronous device copies (a GPU pool) before the pages count as written."""
        if self._async:
            torch.cuda.synchronize(self.pool.device)
