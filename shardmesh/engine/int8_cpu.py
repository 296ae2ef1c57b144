"""int8 weights times float32 activations for a few rows, compiled for this CPU the first time it is needed.

Decode multiplies a few rows by every weight matrix, so its speed is how fast the weights stream from memory,
and int8 weights are a quarter of float32's bytes. PyTorch has no CPU product that reads int8 weights with
float32 activations at that speed: `torch._weight_int8pack_mm` with float32 activations is slower than float32's
own packed product (all SmolLM2 products, one row, 2 threads: 58 against 22 ms), and fast only with bfloat16
activations, which would change the numbers with the tensor-parallel degree (`shardmesh.engine.linear`). This is
the plain loop: for each output row, each input row's dot product with the int8 weights converted to float32 in
registers, four input rows per pass over a weight row, in float32 throughout, vectorized by the compiler for the
CPU it runs on (`-march=native`; `#pragma omp simd`), parallel over output rows with PyTorch's own threads.

It is built with `torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja are needed; about a minute,
once per machine: the build is cached under `~/.cache/torch_extensions`, named by a digest of the source and of
the CPU's flags, so one CPU's build is never loaded on another). Without a compiler `available()` is False, the
reason is in `build_error()`, and the loader chooses another int8 kernel.
"""

from __future__ import annotations

from torch import Tensor

from shardmesh.engine.native import InlineKernel

MAX_ROWS = 8  # beyond this the product is compute-bound and a dequantized float GEMM is faster

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

// y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]; x float32 (M, K), w int8 (N, K), scale float32 (N,).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "int8_linear: expects float32 x and scale, int8 w");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && scale.is_contiguous(), "int8_linear: not contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;
      const float s = sp[n];
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) {  // one pass over the weight row for four input rows
        const float* x0 = xp + m * K;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        #pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int64_t k = 0; k < K; ++k) {
          const float v = static_cast<float>(wr[k]);
          a0 += x0[k] * v; a1 += x0[K + k] * v; a2 += x0[2 * K + k] * v; a3 += x0[3 * K + k] * v;
        }
        yp[m * N + n] = a0 * s; yp[(m + 1) * N + n] = a1 * s;
        yp[(m + 2) * N + n] = a2 * s; yp[(m + 3) * N + n] = a3 * s;
      }
      for (; m < M; ++m) {
        const float* xr = xp + m * K;
        float a = 0.f;
        #pragma omp simd reduction(+:a)
        for (int64_t k = 0; k < K; ++k) a += xr[k] * static_cast<float>(wr[k]);
        yp[m * N + n] = a * s;
      }
    }
  });
  return y;
}
"""

_KERNEL = InlineKernel("shardmesh_int8", _SOURCE, ["int8_linear"], ["-O3", "-march=native", "-fopenmp-simd"])


def available() -> bool:
    """Whether the kernel is built (building it now if it is not cached)."""
    return _KERNEL.module() is not None


def build_error() -> str:
    """Why the kernel could not be built ("" when it was, or was not tried)."""
    return _KERNEL.build_error


def linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """(M, K) float32 rows times int8 (N, K) weights with float32 scales (N,) -> (M, N) float32."""
    ext = _KERNEL.module()
    assert ext is not None, build_error()
    return ext.int8_linear(x.contiguous(), weight, scale)
