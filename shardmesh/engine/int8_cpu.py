"""int8 weights times float32 activations for a few rows, compiled for this CPU the first time it is needed.

Decode multiplies a few rows by every weight matrix, so its speed is how fast the weights stream from memory,
and int8 weights are a quarter of float32's bytes. PyTorch has no CPU product that reads int8 weights with
float32 activations at that speed: `torch._weight_int8pack_mm` with float32 activations is slower than float32's
own packed product (all SmolLM2 products, one row, 2 threads: 58 against 22 ms), and fast only with bfloat16
activations, which would change the numbers with the tensor-parallel degree (`shardmesh.engine.linear`). This is
the plain loop: for each output row and input row, each group's dot product with the int8 weights converted to
float32 in registers, scaled, plus the group's offset times its inputs' sum, in float32 throughout, parallel over
output rows with PyTorch's own threads. Each lane sums its inputs across groups, scaled group by group, and the
lanes are added once per row (AVX-512 intrinsics, two groups at a time into four sums, where the CPU has them; a
loop compiled for the CPU, `-march=native`, elsewhere): adding every group's products across lanes, and c10::Half's
portable float16 conversion, had held it to 1.1 GB/s of SmolLM2's int8 products on one Zen 5 core; now 19 GB/s.
The loader chooses it on CPUs without AVX-512 (which take the blocked kernel of `cpu_kernels`), and an int8 shard's
streamed layers multiply their mapped row-major int8 with it (`offload.StreamedInt8Kernel`; a row-parallel slice's
rows are strided, read in place).

It is built with `torch.utils.cpp_extension.load_inline` (a C++ compiler and ninja are needed; ~15 s on
2 cores, once per machine: the build is cached under `~/.cache/torch_extensions`, named by a digest of the source and of
the CPU's flags, so one CPU's build is never loaded on another). Without a compiler `available()` is False, the
reason is in `build_error()`, and the loader chooses another int8 kernel.
"""

from __future__ import annotations

from torch import Tensor

from shardmesh.core.dtypes import INT8_GROUP
from shardmesh.engine.native import InlineKernel

MAX_ROWS = 8  # beyond this the product is compute-bound and a dequantized float GEMM is faster

# Row-major int8 weights times a few float32 rows (`int8_gemm`, row by row `int8_row`): this kernel's loop, and the
# one `cpu_kernels`' layer halves run on an int8 shard's streamed rows, so both sum alike. Needs GROUP, <vector>,
# <ATen/Parallel.h> and, for the intrinsics, <immintrin.h> before it.
ROW_SOURCE = r"""
// One instruction where the CPU converts float16 (F16C); c10::Half's portable conversion is some twenty, three per
// group of 32 weights: most of the loop's time before.
inline float half_to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// sum over the first `whole` groups of s[g] * sum_{k in g} x[k] q[k]. Each lane sums its inputs of every group,
// scaled group by group, and the lanes are added once, not once per group (adding a group's 32 products across
// lanes, and c10::Half's portable conversion, took most of the loop's time: 1.1 GB/s of SmolLM2's int8 on one core).
inline float whole_groups(const float* x, const int8_t* q, const at::Half* so, int64_t whole) {
#if defined(__AVX512F__)
  static_assert(GROUP == 32, "a group is two vectors of 16 floats");
  // Two groups at a time into four sums, so that consecutive groups' FMAs do not wait on each other.
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= whole; g += 2) {
    const float* xg = x + g * GROUP;
    const int8_t* qg = q + g * GROUP;
    const __m512 s0 = _mm512_set1_ps(half_to_float(so[g * 2])), s1 = _mm512_set1_ps(half_to_float(so[g * 2 + 2]));
    auto widen = [](const int8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(xg), widen(qg)), s0, a0);
    a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + 16), widen(qg + 16)), s0, a1);
    a2 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + 32), widen(qg + 32)), s1, a2);
    a3 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + 48), widen(qg + 48)), s1, a3);
  }
  float total = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
  float total = 0.f;
  int64_t g = 0;
#endif
  for (; g < whole; ++g) {
    float a = 0.f;
    for (int64_t j = 0; j < GROUP; ++j) a += x[g * GROUP + j] * static_cast<float>(q[g * GROUP + j]);
    total += a * half_to_float(so[g * 2]);
  }
  return total;
}

// sum_g s[g] * sum_{k in g} x[k] q[k] over a row of K inputs: its whole groups, then a short last group.
inline float int8_row(const float* x, const int8_t* q, const at::Half* so, int64_t K) {
  const int64_t whole = K / GROUP;
  float total = whole_groups(x, q, so, whole);
  if (whole * GROUP < K) {
    float a = 0.f;
    for (int64_t k = whole * GROUP; k < K; ++k) a += x[k] * static_cast<float>(q[k]);
    total += a * half_to_float(so[whole * 2]);
  }
  return total;
}

// What int8_gemm reads: q int8 (N, K) and so float16 (N, groups, 2), each row contiguous (rows may lie apart).
inline void check_int8_rows(const torch::Tensor& q, const torch::Tensor& so, int64_t K, const char* who) {
  const int64_t G = (K + GROUP - 1) / GROUP;
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.size(1) == K && q.stride(1) == 1, who,
              ": int8 weights must be (N, ", K, ") with contiguous rows, not ", q.scalar_type(), " ", q.sizes());
  TORCH_CHECK(so.scalar_type() == at::kHalf && so.dim() == 3 && so.size(0) == q.size(0) && so.size(1) == G &&
              so.size(2) == 2 && so.stride(2) == 1 && so.stride(1) == 2,
              who, ": scales must be float16 (", q.size(0), ", ", G, ", 2) with contiguous rows, not ",
              so.scalar_type(), " ", so.sizes());
}

// y[m * ldy + n] = sum_g s[n, g] sum_{k in g} x[m, k] q[n, k] + (m[n, g] + 128 s[n, g]) sum_{k in g} x[m, k] + b[n]:
// x float32 (M, K), q int8 (N, K) and so float16 (N, groups, 2), the scale s and minimum m of each group of GROUP
// inputs (a weight is (q + 128) s + m); rows of q and so lie ldw and lds apart (a column slice of wider ones).
inline void int8_gemm(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t ldw, const at::Half* so,
                      int64_t lds, int64_t N, const float* bias, float* y, int64_t ldy) {
  const int64_t G = (K + GROUP - 1) / GROUP;
  std::vector<float> xsum(M * G, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / GROUP] += x[m * K + k];
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* wr = w + n * ldw;
      const at::Half* sr = so + n * lds;
      for (int64_t m = 0; m < M; ++m) {
        float total = int8_row(x + m * K, wr, sr, K);
        for (int64_t g = 0; g < G; ++g)
          total += xsum[m * G + g] * (half_to_float(sr[g * 2 + 1]) + 128.f * half_to_float(sr[g * 2]));
        y[m * ldy + n] = bias ? total + bias[n] : total;
      }
    }
  });
}
"""

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t GROUP = @GROUP@;

@ROW@
// int8_gemm's y (M, N) = x w^T for a float32 x and int8 w with its float16 scales.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor so) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be contiguous float32 (rows, in)");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  // w and so may be column slices of wider tensors (a row-parallel slice streamed from a whole one): rows strided
  check_int8_rows(w, so, K, "int8_linear");
  auto y = torch::empty({M, N}, x.options());
  int8_gemm(x.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), w.stride(0), so.data_ptr<at::Half>(), so.stride(0), N,
            nullptr, y.data_ptr<float>(), N);
  return y;
}
"""

_KERNEL = InlineKernel(
    "shardmesh_int8",
    _SOURCE.replace("@ROW@", ROW_SOURCE).replace("@GROUP@", str(INT8_GROUP)),
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
    (`linear.quantize_groups`) -> (M, N) float32. `weight` and `scale` may be column slices of wider tensors (rows
    apart by their stride: a row-parallel product's share of inputs streamed from the whole one, `offload`)."""
    ext = _KERNEL.module()
    assert ext is not None, build_error()
    return ext.int8_linear(x.contiguous(), weight, scale)
