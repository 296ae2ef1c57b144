"""The C library's allocator, for the services that tune it: the stage worker keeps freed memory for its next step
(`shardworker/heap.py`), the gateway gives the memory of large requests back (`gateway/memory.py`)."""

from __future__ import annotations

import ctypes
import functools
import sys

# mallopt(3) parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The process's C library on Linux (glibc, or another libc whose calls callers check for); None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None
