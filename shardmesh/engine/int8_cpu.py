"""int8 weights times float32 activations for a few rows, compiled for this CPU the first time it is needed.

Decode multiplies a few rows by every weight matrix, so its speed is how fast the weights stream from memory,
and int8 weights are a quarter of float32's bytes. PyTorch has no CPU product that reads int8 weights with
float32 activations at that speed: `torch._weight_int8pack_mm` with float32 activations is slower than float32's
own packed product (all SmolLM2 products, one row, 2 threads: 58 against 22 ms), and fast only with bfloat16
activations, which would change the numbers with the tensor-parallel degree (`shardmesh.engine.linear`). This is
the plain loop: for each output row and input row, each group's dot product with the int8 weights converted to
float32 in registers, scaled, plus the group's offset times its inputs' sum, in float32 throughout, vectorized by
the compiler for the CPU it runs on (`-march=native`; `#pragma omp simd`), parallel over output rows with PyTorch's
own threads. The loader chooses it on CPUs without AVX-512 (which take the blocked kernel of `cpu_kernels`).

It is built with `torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja are needed; about a minute,
once per machine: the build is cached under `~/.cache/torch_extensions`, named by a digest of the source and of
the CPU's flags, so one CPU's build is never loaded on another). Without a compiler `available()` is False, the
reason is in `build_error()`, and the loader chooses another int8 kernel.
"""

from __future__ import annotations

from torch import Tensor

from shardmesh.core.dtypes import INT8_GROUP
from shardmesh.engine.native import InlineKernel

MAX_ROWS = 8  # beyond this the product is compute-bound and a dequantized float GEMM is faster

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

constexpr int64_t GROUP = @GROUP@;

// y[m, n] = sum_g s[n, g] sum_{k in g} x[m, k] q[n, k] + (m[n, g] + 128 s[n, g]) sum_{k in g} x[m, k]: x float32
// (M, K), q int8 (N, K), so float16 (N, groups, 2), the scale s and minimum m of each group of GROUP inputs
// (a weight is (q + 128) s + m).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor so) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = (K + GROUP - 1) / GROUP;
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && K == w.size(1), "int8_linear: shapes do not match");
  TORCH_CHECK(so.dim() == 3 && so.size(0) == N && so.size(1) == G && so.size(2) == 2,
              "int8_linear: scales of ", so.sizes(), " for ", N, " rows of ", G, " groups");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && so.scalar_type() == at::kHalf,
              "int8_linear: expects float32 x, int8 w and float16 scales");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && so.is_contiguous(), "int8_linear: not contiguous");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const at::Half* sp = so.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  std::vector<float> xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / GROUP] += xp[m * K + k];
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = wp + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const float* xr = xp + m * K;
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t k0 = g * GROUP, k1 = std::min(K, k0 + GROUP);
          float a = 0.f;
          #pragma omp simd reduction(+:a)
          for (int64_t k = k0; k < k1; ++k) a += xr[k] * static_cast<float>(wr[k]);
          const float sc = static_cast<float>(sp[(n * G + g) * 2]), mn = static_cast<float>(sp[(n * G + g) * 2 + 1]);
          total += a * sc + xsum[m * G + g] * (mn + 128.f * sc);
        }
        yp[m * N + n] = total;
      }
    }
  });
  return y;
}
"""

_KERNEL = InlineKernel(
    "shardmesh_int8",
    _SOURCE.replace("@GROUP@", str(INT8_GROUP)),
    ["int8_linear"],
    ["-O3", "-march=native", "-fopenmp-simd"],
)


def available() -> bool:
    """Whether the kernel is built (building it now if it is not cached)."""
    return _KERNEL.module() is not None


def build_error() -> str:
    """Why the kernel could not be built ("" when it was, or was not tried)."""
    return _KERNEL.build_error


def linear(x: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    """(M, K) float32 rows times int8 (N, K) weights with their groups' float16 (N, groups, 2) scales and minima
    (`linear.quantize_groups`) -> (M, N) float32."""
    ext = _KERNEL.module()
    assert ext is not None, build_error()
    return ext.int8_linear(x.contiguous(), weight, scale)
