"""What every benchmark here holds fixed and records: the prompt it sends, and the machine it ran on.

Shared by bench/run.py, bench/llamacpp.py and bench/tracing.py, so their numbers are for the same request.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
from pathlib import Path

import psutil

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def machine() -> dict:
    """The host, CPU model, cores, memory and versions: absolute times move by 30% between hosts, so every
    result is recorded beside these."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return {
        "host": socket.gethostname(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
        "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip


def save_results(out: Path, info: dict, suffix: str, md: str, data: dict) -> None:
    """Write `<out>/<host>-<date><suffix>.md` and `.json` (the data beside the machine it ran on), then print
    the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{info['host']}-{info['date'][:10]}{suffix}"
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps({"machine": info, **data}, indent=1))
    print(md)
