"""Giving the memory of large requests back to the system once they are gone (glibc's allocator).

An oversized request is refused at once, but on the way it was received, copied and parsed by a server thread, and
each thread allocates from its own malloc arena. glibc keeps what is freed there for later use, and after a freed
block of 16 MiB it raises its own threshold for giving large blocks their own mapping (up to 32 MiB), so the next
ones come from the arenas too: a flood of 50 prompts of 16 MiB left the gateway at 4.7 times its idle memory for
good (bench/hostile_input.py). Two settings, made once per process by `release_freed_memory()`:

- blocks of `MMAP_THRESHOLD` bytes and more always get their own mapping, which is unmapped when they are freed;
- a thread asks glibc every `CHECK_S` seconds how much memory its arenas hold free, and whenever that grew by
  `GROWTH_BYTES` since its last trim, has it return their free pages to the system (`malloc_trim`). A look costs
  a walk over the arenas' free lists; a trim happens only after such growth.

Elsewhere than on glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from shardmesh.rpc.malloc import M_MMAP_THRESHOLD, libc

MMAP_THRESHOLD = 1024 * 1024
CHECK_S = 1.0
GROWTH_BYTES = 64 * 1024 * 1024

_started = False
_lock = threading.Lock()


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33 and later)."""

    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def glibc() -> Any | None:
    """The C library when it is a glibc with malloc_trim and mallinfo2, else None."""
    c = libc()
    if c is None or not all(hasattr(c, f) for f in ("malloc_trim", "mallopt", "mallinfo2")):
        return None
    c.mallinfo2.restype = _MallInfo2
    return c


def free_in_arenas(libc: Any) -> int:
    """Bytes the arenas hold free (returned to the system or not)."""
    return int(libc.mallinfo2().fordblks)


def release_freed_memory() -> None:
    """Both settings of the module's docstring, once per process (later calls do nothing)."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    libc = glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    threading.Thread(target=_watch, args=(libc, threading.Event()), name="memory-release", daemon=True).start()


def _watch(libc: Any, stop: threading.Event, check_s: float = CHECK_S, growth: int = GROWTH_BYTES) -> None:
    """Until `stop`: trim whenever the free memory of the arenas grew by `growth` since the last trim. (What a trim
    returns stays counted as free, so the count after a trim is the mark; it follows the count down as memory is
    used again.)"""
    mark = free_in_arenas(libc)
    while not stop.wait(check_s):
        free = free_in_arenas(libc)
        if free > mark + growth:
            libc.malloc_trim(0)  # ctypes releases the interpreter lock for the call
        mark = free if free > mark + growth else min(mark, free)
