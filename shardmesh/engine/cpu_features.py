"""What this CPU can do, from the flags the kernel reports: the same torch build runs on hosts with and without
AVX-512, VNNI or bfloat16 instructions, and kernels are chosen (or compiled) for the one they run on."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
                          []))  # fmt: skip
