"""How fast this host reads memory, measured in the same run as the meshes: the floor under a one-stream decode step.

A decode step of one sequence reads every weight of the model once (the head's too; the embedding only a row where the
head is a matrix of its own), so at best it takes those bytes (`weight_bytes`) over the rate at which the step's
threads can read memory. The probe reads a buffer of exactly that size the way the CPU decode path's products read
their weights: each of `threads` threads a contiguous share, every 64-byte line once, with a software prefetch 4 KiB
ahead into L1 (as `cpu_kernels` asks for float32's blocks), folding the words together so that no read can be left
out. The size matters: the Xeons here have a 300 MiB last-level cache that keeps part of a smaller buffer from one
pass to the next (2 threads: ~50 GB/s at 100 MB, ~46 at 200, ~36 at 538 MB, where SmolLM2's float32 weights lie).

What it leaves out, so that the floor is a little low: the KV cache's reads (~1% of a step at the bench's lengths),
the activations, and the work between the products.

    from bench import read_probe
    rate = read_probe.measure(read_probe.weight_bytes(model_dir, "float32"), threads=2)  # GB/s of each pass
"""

from __future__ import annotations

import json
import statistics
from functools import cache
from pathlib import Path

import torch

from shardmesh.engine.native import InlineKernel

_SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <omp.h>
#include <vector>

// `passes` passes over `buffer` on `threads` threads, each a contiguous share, every 64-bit word xored into its
// thread's sums, and a prefetch 4 KiB ahead once per 64-byte line. Returns (each pass's seconds, the xor of all the
// words), the latter so that every word is read and a caller can check it was.
std::tuple<std::vector<double>, int64_t> read_passes(torch::Tensor buffer, int64_t threads, int64_t passes) {
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous() && buffer.scalar_type() == at::kLong,
              "read_passes: the buffer must be a contiguous 1-D int64 tensor");
  TORCH_CHECK(threads >= 1 && passes >= 1, "read_passes: threads and passes must be >= 1");
  const auto* w = reinterpret_cast<const uint64_t*>(buffer.data_ptr<int64_t>());
  const int64_t n = buffer.numel();
  std::vector<double> seconds;
  uint64_t all = 0;
  for (int64_t p = 0; p < passes; ++p) {
    uint64_t folded = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(^ : folded)
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t begin = n * t / T, end = n * (t + 1) / T;
      uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = begin;
      for (; i + 8 <= end; i += 8) {
        __builtin_prefetch(w + i + 512, 0, 3);
        for (int j = 0; j < 8; ++j) a[j] ^= w[i + j];
      }
      for (; i < end; ++i) a[0] ^= w[i];
      for (int j = 0; j < 8; ++j) folded ^= a[j];
    }
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    all = folded;
  }
  return {seconds, static_cast<int64_t>(all)};
}
"""

_KERNEL = InlineKernel("shardmesh_read_probe", _SOURCE, ["read_passes"], ["-O3", "-march=native"])
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """The bytes of weights one decode step of one sequence reads, the checkpoint's tensors in `dtype`: every tensor
    once, but the embedding where a separate `lm_head.weight` is the head (a step gathers one row of it)."""
    from safetensors import safe_open

    numel: dict[str, int] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safe_open handle is not a mapping)
                shape = f.get_slice(name).get_shape()
                numel[name] = int(torch.Size(shape).numel())
    total = sum(numel.values())
    embed = next((n for k, n in numel.items() if k.endswith("embed_tokens.weight")), 0)
    if any(k.endswith("lm_head.weight") for k in numel):
        total -= embed
    return total * ELEMENT_BYTES[dtype]


@cache
def _buffer(nbytes: int) -> torch.Tensor:
    """A buffer of `nbytes` (rounded down to whole words), written once so that its pages exist; kept for the
    process, as a bench measures the same sizes round after round."""
    return torch.arange(nbytes // 8, dtype=torch.int64)


def measure(nbytes: int, threads: int, passes: int = 10) -> list[float]:
    """GB/s of each of `passes` reads of `nbytes` on `threads` threads (after one pass not counted)."""
    ext = _KERNEL.module()
    if ext is None:
        raise RuntimeError(f"the read probe could not be built: {_KERNEL.build_error}")
    buffer = _buffer(nbytes)
    seconds, _ = ext.read_passes(buffer, threads, passes + 1)
    return [buffer.numel() * 8 / s / 1e9 for s in seconds[1:]]


def folded(nbytes: int, threads: int) -> int:
    """The xor of every word the probe reads in a buffer of `nbytes`: what a test checks against."""
    ext = _KERNEL.module()
    assert ext is not None, _KERNEL.build_error
    return int(ext.read_passes(_buffer(nbytes), threads, 1)[1])


def floor_ms(nbytes: int, gbps: list[float]) -> float:
    """A step's floor in ms: `nbytes` at the median of the probe's rates."""
    return nbytes / (statistics.median(gbps) * 1e9) * 1e3


if __name__ == "__main__":
    import argparse

    from shardmesh.models.registry import resolve

    p = argparse.ArgumentParser(description="This host's read rate over a model's weights' bytes, and the floor.")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32", choices=sorted(ELEMENT_BYTES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=20)
    a = p.parse_args()
    size = weight_bytes(resolve(a.model), a.dtype)
    rates = measure(size, a.threads, a.passes)
    print(json.dumps({"bytes": size, "gbps_median": statistics.median(rates), "gbps": [round(r, 2) for r in rates],
                      "floor_ms": floor_ms(size, rates)}))  # fmt: skip
