"""The rates `shardmesh plan` predicts an offload step from: parsed from flags (`25GB/s`), or measured on this host
for cpu workers, by doing what a streaming worker does (`shardmesh.engine.offload`) to a scratch file:

  link    the file's pages in the page cache brought into the process and read once, a chunk at a time:
          `madvise(MADV_POPULATE_READ)` on the chunk, one pass over its bytes, `madvise(MADV_DONTNEED)` (the
          prefetch, the product's read and the drop of a streamed layer);
  memory  the same number of bytes of anonymous memory read once (a resident weight's read);
  disk    the link's pass once more after `posix_fadvise(POSIX_FADV_DONTNEED)` dropped the file from the page
          cache: a cold step reads the checkpoint's disk (not reported when the pages stayed cached, as on tmpfs).

Reads are `numpy.count_nonzero` over 8-byte words on one thread (a worker computes on one), the fastest full pass
numpy offers here: 16.4 GB/s against 12.5 GB/s for a float32 sum and 10.4 GB/s over bytes (256 MiB, medians of 5,
2026-11-24, 2-vCPU AMD EPYC). Link and memory passes alternate, and each rate is the median of its passes.
I/O only here: the planner gets the numbers (`offload.LinkRates`), and unit tests give them.
"""

from __future__ import annotations

import mmap
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from shardmesh.core.units import parse_bytes
from shardmesh.planning.offload import LinkRates, Rate

MiB = 2**20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # <sys/mman.h>; Linux 5.14+
# A cold pass within this fraction of the cached one did not reach a disk (tmpfs, or pages kept by the kernel).
COLD_FRACTION = 0.5
_RATE = re.compile(r"^\s*(?P<size>[^/]+?)\s*(?:/\s*s)?\s*$")


def parse_rate(text: str, flag: str) -> float:
    """``"25GB/s"`` (or ``"25GB"``) → 25e9 bytes per second, units as `core.units.parse_bytes`. Raises ValueError
    naming `flag` and the value."""
    m = _RATE.match(text)
    try:
        rate = float(parse_bytes(m.group("size"))) if m else 0.0
    except ValueError:
        rate = 0.0
    if not rate > 0:
        raise ValueError(f"{flag}: expected a rate like 25GB/s or 900MiB/s (bytes per second, > 0), got {text!r}")
    return rate


def _write(path: Path, size: int, chunk: int) -> None:
    """`size` bytes of random data (not zeros: no filesystem may keep them sparse), flushed so that the page cache
    can drop them."""
    block = np.random.default_rng(0).integers(0, 2**63, chunk // 8, dtype=np.uint64).tobytes()
    with path.open("wb") as f:
        for _ in range(size // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _seconds(run: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def _stream(mm: mmap.mmap, words: np.ndarray, chunk: int, populate: list[int]) -> None:
    """One link pass: each chunk populated, read and dropped, as a worker streams a layer."""
    for at in range(0, len(mm), chunk):
        try:
            mm.madvise(populate[0], at, chunk)
        except OSError:  # an older kernel: readahead instead, and the pass faults the pages in
            populate[0] = mmap.MADV_WILLNEED
            mm.madvise(populate[0], at, chunk)
        np.count_nonzero(words[at // 8 : (at + chunk) // 8])
        mm.madvise(mmap.MADV_DONTNEED, at, chunk)


def _passes(f: BinaryIO, size: int, chunk: int, repeats: int) -> tuple[list[float], list[float], float]:
    """Seconds of each link pass and each memory pass (alternating), and of one cold link pass."""
    with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
        words = np.frombuffer(mm, dtype=np.uint64)
        anonymous = np.ones(size // 8, dtype=np.uint64)
        populate = [MADV_POPULATE_READ]
        _stream(mm, words, chunk, populate)  # the file's pages are cached already (just written): warms the paths
        link, memory = [], []
        for _ in range(repeats):
            link.append(_seconds(_stream, mm, words, chunk, populate))
            memory.append(_seconds(np.count_nonzero, anonymous))
        os.posix_fadvise(f.fileno(), 0, size, os.POSIX_FADV_DONTNEED)
        cold = _seconds(_stream, mm, words, chunk, populate)
        del words  # the mapping closes only once no array views it
    return link, memory, cold


def measure(directory: str | Path | None = None, size: int = 128 * MiB, chunk: int = 32 * MiB,
            repeats: int = 5) -> LinkRates:  # fmt: skip
    """The link, memory and disk rates of this host (module docstring), with a scratch file of `size` bytes in
    `directory` (default: the temporary directory), read `chunk` bytes at a time."""
    if size < chunk or size % chunk or chunk % mmap.PAGESIZE:
        raise ValueError(f"size {size} must be a multiple of chunk {chunk}, itself of the page size")
    with tempfile.TemporaryDirectory(dir=directory, prefix="shardmesh-link-") as scratch:
        path = Path(scratch) / "probe.bin"
        _write(path, size, chunk)
        with path.open("rb") as f:
            link, memory, cold = _passes(f, size, chunk, repeats)
    hot = size / statistics.median(link)
    how = f"{size // MiB} MiB in {chunk // MiB} MiB chunks, median of {repeats}"
    disk = None
    if size / cold < COLD_FRACTION * hot:
        disk = Rate(size / cold, f"measured here: {size // MiB} MiB from a file dropped from the page cache")
    return LinkRates(
        Rate(hot, f"measured here: page cache into the process, {how}"),
        Rate(size / statistics.median(memory), f"measured here: memory read on one thread, {how}"),
        disk,
    )
