"""Optional process tuning for hosts that move KV through host memory (the zmq backend).

ZMQ allocates every received frame with ``malloc``. glibc serves large requests with fresh
``mmap`` pages, so each received chunk is page-faulted and zeroed by the kernel before ZMQ copies
into it: an extra pass over memory that a ``recv_into`` a warm pool never pays. Raising glibc's
mmap and trim thresholds makes freed frame buffers reusable from the heap. This is process-wide, so
it is never done implicitly: a worker (or benchmark) calls :func:`tune_host_allocator` at start-up.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc refuses mmap thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MAX_MMAP_THRESHOLD = 32 << 20


def tune_host_allocator(mmap_threshold: int = MAX_MMAP_THRESHOLD,
                        trim_threshold: int = 1 << 30) -> bool:
    """Keep buffers up to ``mmap_threshold`` bytes on the heap and up to ``trim_threshold`` bytes of
    free heap mapped. Returns False (and changes nothing) where glibc's ``mallopt`` is missing."""
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
    logger.info("host allocator tuning %s (mmap threshold %d, trim threshold %d)",
                "applied" if ok else "refused", mmap_threshold, trim_threshold)
    return ok
