"""Keep the memory a step frees, so that the next step does not fault it back in page by page.

A prefill step allocates activations of megabytes (tokens x intermediate size x 4 bytes) and frees
them when it ends. glibc's malloc hands such blocks back to the kernel: blocks above its mmap threshold
are unmapped on free, and a heap's free top above its trim threshold is released. The next step then
touches fresh pages, and each first touch is a page fault that zeroes 4 KiB. Measured on SmolLM2, 16
prompts of 46 tokens in one step on 2 threads: 474-671 ms with 1.6-29 k page faults per step, against
457-472 ms and none once the thresholds below are set; 0.1-0.2 s of the slow steps was kernel time.

The cost is that the worker's resident memory stays at its peak instead of shrinking between bursts,
which is what a server that reserved its KV cache up front wants anyway. Loading a shard is the
opposite case: what it frees (each dense weight once its packed copy exists) is never reused, and kept,
it raised a stage's peak by ~125 MiB over the memory model's estimate (416 MiB of weights,
tests/test_planning_memory.py). So loads run under glibc's fixed default thresholds (`loading`), and
what they leave free is handed back before the steps start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from shardmesh.rpc import malloc
from shardmesh.rpc.malloc import M_MMAP_THRESHOLD, M_TOP_PAD, M_TRIM_THRESHOLD

TRIM_THRESHOLD = 1 << 30  # free heap top the process keeps rather than returns
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap, not their own mapping
TOP_PAD = 64 << 20  # grow the heap in steps of this much, not one block's size at a time
_SERVING = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
# glibc's initial values: blocks over 128 KiB get their own mapping, a free heap top over 128 KiB is returned.
_LOADING = ((M_MMAP_THRESHOLD, 128 << 10), (M_TRIM_THRESHOLD, 128 << 10), (M_TOP_PAD, 0))
_kept = False  # whether keep_freed_memory succeeded in this process


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse. Returns False where that is not possible
    (not Linux, or a C library without mallopt, such as musl); the process then runs as before."""
    global _kept
    # Setting any of these also turns off glibc's dynamic thresholds, which would move them again.
    _kept = _mallopt(_SERVING)
    return _kept


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Around a shard load: freed blocks go back to the OS at once, as by glibc's defaults; afterwards what
    the load left free is released (`malloc_trim`) and freed memory is kept again. A no-op unless
    `keep_freed_memory` succeeded."""
    if not _kept:
        yield
        return
    _mallopt(_LOADING)
    try:
        yield
    finally:
        libc = malloc.libc()
        if libc is not None:
            libc.malloc_trim(0)
        _mallopt(_SERVING)


def _mallopt(settings: tuple[tuple[int, int], ...]) -> bool:
    libc = malloc.libc()
    with contextlib.suppress(AttributeError):
        return libc is not None and all(libc.mallopt(param, value) == 1 for param, value in settings)
    return False
