"""Optional process tuning for hosts that move KV through host memory (the zmq backend).

ZMQ allocates every received frame with ``malloc``. glibc serves large requests with fresh
``mmap`` pages, so each received chunk is page-faulted and zeroed by the kernel before ZMQ copies
into it: an extra pass over memory that a ``recv_into`` a warm pool never pays. Raising glibc's
mmap and trim thresholds makes freed frame buffers reusable from the heap.

That is not enough on its own: ZMQ's I/O thread mallocs the frames, and glibc gives every new
thread its own arena, made of 64 MiB heaps that are unmapped as soon as they are empty (whatever the
trim threshold). Each transfer then maps fresh heaps, faults and zeroes them again, which measured
~30 ms on a 128 MiB transfer that raw TCP moves in ~40 ms. One arena (``M_ARENA_MAX`` 1) keeps the
frames on the main heap, which the trim threshold keeps mapped. This is process-wide, so it is never
done implicitly: a worker (or benchmark) calls :func:`tune_host_allocator` at start-up, before it
starts threads (ZMQ contexts, torch's thread pool).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MAX_MMAP_THRESHOLD = 32 << 20


def tune_host_allocator(mmap_threshold: int = MAX_MMAP_THRESHOLD,
                        trim_threshold: int = 1 << 30, arena_max: int | None = 1) -> bool:
    """Keep buffers up to ``mmap_threshold`` bytes on the heap, up to ``trim_threshold`` bytes of
    free heap mapped, and at most ``arena_max`` malloc arenas (None: leave glibc's default).
    Returns False (and changes nothing) where glibc's ``mallopt`` is missing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, min(mmap_threshold, MAX_MMAP_THRESHOLD))) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold))
    if ok and arena_max is not None:
        ok = bool(mallopt(M_ARENA_MAX, arena_max))
    logger.info("host allocator tuning %s (mmap threshold %d, trim threshold %d, arenas %s)",
                "applied" if ok else "refused", mmap_threshold, trim_threshold,
                arena_max if arena_max is not None else "default")
    return ok
