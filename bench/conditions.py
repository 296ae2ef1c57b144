"""What every benchmark here holds fixed and records: the prompt it sends, and the machine it ran on.

Shared by bench/run.py, bench/llamacpp.py and bench/tracing.py, so their numbers are for the same request; and how
the benches of several processes (bench/tp_allreduce.py, bench/pp_link.py) start them (`spawned`); and how the
benches that time each way in a process of its own run those children (`child_json`, `alternated`).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent  # the repository root
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
BOUNDARY_GOAL_MS = 0.5  # issue 19's target for a pipeline's stage boundary per decode step
# The flags that choose the kernels (linear.cpu_has_native_bf16, the int8 paths) or bound what bfloat16 and
# int8 can gain on a CPU: the same torch build picks different code on hosts with and without them.
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
             "amx_int8")  # fmt: skip


def cpu_flags() -> list[str]:
    """Which of `CPU_FLAGS` this CPU has, in `CPU_FLAGS`' order."""
    from shardmesh.engine.cpu_features import cpu_flags as flags

    return [f for f in CPU_FLAGS if f in flags()]


def cpu_id() -> str:
    """The CPU's vendor, family, model and stepping: a virtual machine's model name ("AMD EPYC") alone does
    not tell the generation."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]  # the first CPU's block
    except OSError:
        return ""
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first.splitlines())}
    return ", ".join(f"{k} {fields[k]}" for k in ("vendor_id", "cpu family", "model", "stepping") if k in fields)


def machine() -> dict:
    """The host, CPU model and the flags that pick its kernels, cores, memory and versions: absolute times move
    by 30% between hosts, and bfloat16 or int8 speeds by far more between CPUs with and without native
    instructions for them, so every result is recorded beside these."""
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    return {
        "host": socket.gethostname(), "cpu": cpu, "cpu_id": cpu_id(), "cpu_flags": cpu_flags(),
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
        "torch": torch.__version__, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "load_avg_1m": round(os.getloadavg()[0], 2),  # at the start: above the core count, other work competed
    }  # fmt: skip


def save_results(out: Path, info: dict, suffix: str, md: str, data: dict) -> None:
    """Write `<out>/<host>-<date><suffix>.md` and `.json` (the data beside the machine it ran on), then print
    the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{info['host']}-{info['date'][:10]}{suffix}"
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps({"machine": info, **data}, indent=1))
    print(md)


def pythonpath(tree: Path = ROOT) -> str:
    """PYTHONPATH for a bench's child process: the checkout `tree` first, whatever is installed, then the caller's
    path (packages installed with `pip --target`, say)."""
    return os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)


def child_json(args: list[str], env: dict[str, str] | None = None, what: str = "child") -> Any:
    """Run `args` (a bench's own child mode) from the repository root with this checkout first on PYTHONPATH
    (`pythonpath`) and `env` over this process's environment, and return its last line of output as JSON. A child
    that fails ends the bench with its exit status and the end of its stderr, named by `what`."""
    done = subprocess.run(args, env={**os.environ, **(env or {}), "PYTHONPATH": pythonpath()}, cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternated(names: list[str], round_index: int) -> list[str]:
    """`names` in order in even rounds (counted from 0) and reversed in odd ones, so that each way meets the host's
    drift from both sides."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def spawned(target: Any, count: int, args: dict[str, Any], timeout: timedelta) -> Any:
    """Run `target(port, i, args, out)` in `count` fresh interpreters (spawn) that meet at a store this process
    serves on a free loopback port, and return the first thing one of them puts on `out`; every process is
    joined, or killed if it has not ended a minute later."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(store.port, i, args, out)) for i in range(count)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=600)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def interval_side(interval: tuple[float, float], goal: float = BOUNDARY_GOAL_MS) -> str:
    """Where an interval lies against an upper bound `goal`: "at or below" it whole, "above" it whole, or it "holds"
    the goal (a run that cannot tell what it measured from the goal)."""
    low, high = interval
    return "at or below" if high <= goal else "above" if low > goal else "holds"


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """An interval that holds the median of the distribution `values` were drawn from with at least `confidence`,
    whatever that distribution: the k-th smallest and k-th largest value, k the largest with P(B < k) <= (1 -
    confidence) / 2 for B ~ Binomial(n, 1/2), the count of values below the median. None below 6 values (95%)."""
    xs, n = sorted(values), len(values)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None
