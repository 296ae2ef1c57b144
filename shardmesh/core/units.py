"""Byte sizes as people write them (``24GiB``, ``80GB``, ``512MiB``) and as the planner prints them.

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB) powers of 1000,
so ``80GB`` is 80e9 bytes and ``80GiB`` is 80 × 2^30 = 85.9e9 bytes. A bare number is bytes.
"""

from __future__ import annotations

import re

UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """``"24GiB"`` → 25769803776. Raises ValueError naming the accepted units."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0 bytes, got {text}")
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in UNITS:
        raise ValueError(f"expected a size like 24GiB, 80GB or 512MiB (units: B, KB/MB/GB/TB, KiB/MiB/GiB/TiB), "
                         f"got {text!r}")  # fmt: skip
    return round(float(m.group(1)) * UNITS[unit])


def format_bytes(n: float) -> str:
    """Binary units, two decimals: 16.06e9 → ``'14.96 GiB'``; negative sizes keep their sign."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
