"""A worker's speed, as one number the coordinator can compare: its matrix-multiply throughput in GFLOP/s.

Measured once at start on the worker's own device and threads: the product of a few rows by a square weight,
the shape of a decode step's projections (memory-bound on CPUs and GPUs alike, as decoding is), best of several
runs, because other work on the host only ever makes a run slower. Workers measured on the same kind of device
with the same threads share a *speed class*: the coordinator takes their speeds as equal, so the noise between
two identical machines never moves a slot (`coordinator/rebalance.py`).
"""

from __future__ import annotations

import time

import torch


def speed_class(device: torch.device, device_name: str) -> str:
    """What makes two measured speeds comparable: the kind of device and, on a CPU, the threads used."""
    threads = f"/{torch.get_num_threads()}threads" if device.type == "cpu" else ""
    return f"{device.type}:{device_name}{threads}"


def measure_gflops(device: torch.device, dtype: torch.dtype = torch.float32, size: int = 1024, rows: int = 16,
                   runs: int = 5, min_s: float = 0.02) -> float:  # fmt: skip
    """Best GFLOP/s of `runs` timed runs of (rows × size) @ (size × size), each repeated for at least `min_s`."""
    x = torch.randn(rows, size, dtype=dtype, device=device)
    w = torch.randn(size, size, dtype=dtype, device=device)
    flops = 2 * rows * size * size
    best = 0.0
    for _ in range(runs):
        n, t0 = 0, time.perf_counter()
        while True:
            torch.mm(x, w)
            n += 1
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                break
        best = max(best, flops * n / elapsed / 1e9)
    return best
