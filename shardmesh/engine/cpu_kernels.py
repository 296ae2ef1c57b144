"""Decode-speed CPU kernels, compiled for the CPU they run on: a blocked matrix product and a decoder layer's two
halves.

**The product** (`pack`, `linear`), for float32, bfloat16 and int8 weights. A decode step multiplies a few rows by every
weight, so it runs at the speed weights stream from memory. Weights are re-stored once, at load, in blocks of `NB`
output features: block b holds W[b·NB : (b+1)·NB, :] as (K, NB), features innermost, so the loop over K broadcasts one
input value and multiplies it by NB weights at once (no horizontal sums). bfloat16 weights are stored as (K/2, NB, 2)
pairs, the operand layout of AVX512-BF16's `vdpbf16ps`, which multiplies bfloat16 activations by them two at a time with
float32 sums, and of AMX's tiles, which take 16 rows by 32 inputs by 16 outputs per instruction: CPUs with AMX-BF16
multiply on the tiles (`SHARDMESH_CPU_AMX=0` keeps them to vdpbf16ps), CPUs without either widen each weight to float32
in registers for FMAs; so do CPUs with vdpbf16ps for products of several rows where it is the slower way on their cores
(a probe at load decides, `choose_bf16_rows`; same numbers either way). int8 weights (a float16 scale and minimum per
group of `INT8_GROUP` inputs, applied to each group's sums) are stored as float32's and widened in registers: a quarter
of the bytes, plus an eighth of that for the groups' scales. Rows are taken eight (then four) at a time per pass over a
block, their sums in registers (AVX-512: eight rows' in 16 registers; AVX2, whose 16 registers hold a row's 32 sums in
four, takes them two or three at a time within the pass; other CPUs get a loop the compiler vectorizes,
`-march=native`), so a block is read from memory once per step whatever the rows (it stays in L2 while they use it).
On AVX2, 8 rows or more walk each block in tiles of 128 inputs instead, six rows at a time over each half of a tile
held in L1 (bfloat16's widened once per tile), each pass asking for the next tile ahead (`tiled`).
Parallel over blocks on PyTorch's threads. Measured on a 2-core Zen 4 (SmolLM2, 2 threads): all products for one row,
float32 16.6 ms (32.5 GB/s) against oneDNN's packed product 22.8 ms, bfloat16 7.5-10 ms against 20-22 ms for PyTorch's
bfloat16 product; the whole decode step of 16 sequences (with `cpu_decode`) float32 35.8 ms against 57.7 eager on
oneDNN's, bfloat16 26.8 against 49.2; a prefill of 16 x 46 tokens float32 1036 against 1015 ms, bfloat16 652 against 611
ms.

The packed weight is returned as an (N, K) view over the blocked buffer (`pack`): `weight.shape` stays what the
checkpoint says and its storage holds the padded blocks, as oneDNN's packed weights do; `unpack` gives the (N, K)
values back. Never copy it with `clone()` (that copies N·K elements, not the blocks).

**The decoder layer's halves** (`attention_block`, `mlp_block`), for `cpu_decode`: a decode step's small operations
(norms, RoPE, the KV write, attention, SwiGLU, residuals) are ~70 PyTorch calls per layer, ~0.4 ms of dispatch per
layer on this CPU, as much as the layer's products. Each half is one call here, computing in float32 and rounding to
the activations' dtype exactly where the eager model does (`Transformer` in `model.py`), so a bfloat16 shard gives
the eager path's numbers up to the order of sums. `decode_layers` runs every layer of a shard whose layers are whole
(no tensor-parallel all-reduce, no streamed weights) in one call, the halves one after the other, over the layers'
arguments converted once (`stack_layers`); `decode_layers_reduced` does the same for a tensor-parallel rank, calling
its shared-memory group's all-reduce between the halves.

Built with `torch.utils.cpp_extension.load_inline` through `native.InlineKernel` (cached per CPU and torch version),
for the widest instructions the CPU has: AVX-512 (with its bfloat16 instructions and AMX tiles where present), else
AVX2 with FMA, else plain loops. `SHARDMESH_CPU_ISA=avx2` builds the AVX2 paths on a CPU with AVX-512 too (the tests
run both there; benchmarks can compare them). Without a compiler `available()` is False and the loader keeps
PyTorch's products.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import structlog
import torch
from torch import Tensor

from shardmesh.core.dtypes import INT8_GROUP
from shardmesh.engine import int8_cpu, shm_collective
from shardmesh.engine.native import InlineKernel

NB = 32  # output features per block: two AVX-512 registers of float32
AMX_ENV = "SHARDMESH_CPU_AMX"  # 0: bfloat16 products keep to AVX512-BF16 on a CPU with AMX (read by the C++ once)

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX512BF16__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
// Without AVX-512, AVX2 with FMA (every x86 server since 2013) gets 8-wide versions of the same loops: the blocked
// products' sums in registers, e^x eight at a time, the grouped attention. Only the plain loops remain below that.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SHARDMESH_AVX2 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define SHARDMESH_AMX 1
#endif

constexpr int64_t NB = 32;

static inline float bf2f(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {  // round to nearest even, as PyTorch's float -> bfloat16 (NaN kept NaN)
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float round_to(bool bf16, float f) { return bf16 ? bf2f(f2bf(f)) : f; }

// Uninitialized float32 scratch: std::vector's zeroing of a step's buffers was 1.3% of a 16-row bfloat16 step.
using Scratch = std::unique_ptr<float[]>;
static inline Scratch scratch(int64_t n) { return Scratch(new float[n]); }

// ---------------------------------------------------------------------------------------------------------------
// Elementwise work, a vector at a time (16 lanes on AVX-512, 8 on AVX2) with the same roundings as round_to and f2bf
// (a scalar loop takes the tail, and every element on other CPUs). Scalar, the norms, residuals, RoPE and SwiGLU of a
// 16-row bfloat16 step kept one thread busy for ~4 of its 28 ms while the other waited.
// ---------------------------------------------------------------------------------------------------------------
template <typename T>
static inline float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i]; else return bf2f(reinterpret_cast<const uint16_t*>(p)[i]);
}
template <typename T>
static inline void put(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>) p[i] = v; else reinterpret_cast<uint16_t*>(p)[i] = f2bf(v);
}

#ifdef __AVX512F__
#define SHARDMESH_LANES 16
using Lanes = __m512;
// f2bf's bits in each lane's high half (the low half zero): round to nearest even, a NaN kept NaN (quieted).
static inline __m512i bf16_high(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), high);
  const __m512i quiet = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), high);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}
static inline __m512 vround(bool bf16, __m512 v) { return bf16 ? _mm512_castsi512_ps(bf16_high(v)) : v; }
static inline __m512 vload(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 vload(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline void vput(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void vput(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_high(v), 16)));
}
static inline __m512 vset(float f) { return _mm512_set1_ps(f); }
static inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 vsub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
static inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static inline __m512 vdiv(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
// A sum of squares in double (each square exact there), 16 values at a time.
struct SumSq {
  __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
  void add(__m512 v) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    s0 = _mm512_fmadd_pd(lo, lo, s0);
    s1 = _mm512_fmadd_pd(hi, hi, s1);
  }
  double total() const { return _mm512_reduce_add_pd(_mm512_add_pd(s0, s1)); }
};
#elif defined(SHARDMESH_AVX2)
#define SHARDMESH_LANES 8
using Lanes = __m256;
static inline __m256i bf16_high(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), high);
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), high);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet),
                                              _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
static inline __m256 vround(bool bf16, __m256 v) { return bf16 ? _mm256_castsi256_ps(bf16_high(v)) : v; }
static inline __m256 vload(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 vload(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
static inline void vput(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void vput(at::BFloat16* p, __m256 v) {
  const __m256i b = _mm256_srli_epi32(bf16_high(v), 16);  // each lane <= 0xffff: packus keeps it as is
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
static inline __m256 vset(float f) { return _mm256_set1_ps(f); }
static inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static inline __m256 vsub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
static inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static inline __m256 vdiv(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
struct SumSq {
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  void add(__m256 v) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    s0 = _mm256_fmadd_pd(lo, lo, s0);
    s1 = _mm256_fmadd_pd(hi, hi, s1);
  }
  double total() const {
    const __m256d s = _mm256_add_pd(s0, s1);
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
  }
};
#endif
#ifdef SHARDMESH_LANES
constexpr int64_t L = SHARDMESH_LANES;
#endif

// p[i] = round_to(bf16, p[i]) for n values.
static void round_all(bool bf16, float* p, int64_t n) {
  if (!bf16) return;
  int64_t i = 0;
#ifdef SHARDMESH_LANES
  for (; i + L <= n; i += L) vput(p + i, vround(true, vload(p + i)));
#endif
  for (; i < n; ++i) p[i] = round_to(true, p[i]);
}

// out[i] = x[i] + y[i] (x, out in T; y float32), rounded once to T, as the eager residual add.
template <typename T>
static void add_into(const T* x, const float* y, T* out, int64_t n) {
  int64_t i = 0;
#ifdef SHARDMESH_LANES
  for (; i + L <= n; i += L) vput(out + i, vadd(vload(x + i), vload(y + i)));
#endif
  for (; i < n; ++i) put(out, i, load(x, i) + y[i]);
}
// out[i] = y[i] in T.
template <typename T>
static void put_all(const float* y, T* out, int64_t n) {
  int64_t i = 0;
#ifdef SHARDMESH_LANES
  for (; i + L <= n; i += L) vput(out + i, vload(y + i));
#endif
  for (; i < n; ++i) put(out, i, y[i]);
}

// f(p) with t's data as const float* or const at::BFloat16* (t contiguous, float32 or bfloat16).
template <typename F>
static void with_data(const torch::Tensor& t, F&& f) {
  TORCH_CHECK(t.is_contiguous(), "expected a contiguous tensor");
  if (t.scalar_type() == at::kBFloat16) f(t.data_ptr<at::BFloat16>());
  else if (t.scalar_type() == at::kFloat) f(t.data_ptr<float>());
  else TORCH_CHECK(false, "expected float32 or bfloat16, not ", t.scalar_type());
}

// ---------------------------------------------------------------------------------------------------------------
// The blocked product: y[m, n] = sum_k x[m, k] w[n, k] + b[n], x float32 (M, K) with row stride xs.
// ---------------------------------------------------------------------------------------------------------------

#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
// On the first pass over a block (`Ahead`: its weights come from memory; later passes of more rows find it in L2),
// float32 weights are asked for F32_AHEAD inputs on (4 KiB, both lines of each input's 32 weights), into L1. On a Xeon
// of family 6 model 207 the CPU's own prefetch left the loop waiting: SmolLM2's products took 0.91x the time at one
// row and 0.69x at 16 with it (8 and 16 KiB ahead: 0.93-0.96x and 0.72x; 2 KiB: 0.96x and 0.79x). On a Zen 5 an
// earlier try (8 KiB ahead, into L2) changed nothing there.
constexpr int64_t F32_AHEAD = 32;
// A step's 128 bytes of weights (a float32 input's 32, or a bfloat16 pair's) asked for into L1. bfloat16's pairs
// (vdpbf16ps and widened) ask as far ahead, also on a first pass only: on the same Xeon a whole SmolLM2 decode step in
// bfloat16 took 12.2 against 14.5 ms at one row, 29.2 against 36.3 at 16 (4 alternated rounds of 20 steps); 2 and
// 8 KiB ahead measured the same as 4 within noise.
static inline void ask_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(p) + 64, _MM_HINT_T0);
}
#endif

#ifdef __AVX512F__
// A block's sums for MB rows in registers, two of 16 outputs per row, `step(a, i)` adding step i's products, then
// stored to acc (MB x NB). Explicit registers: a generic loop over NB keeps MB x NB sums in memory for MB > 1 (16 rows
// ran 3x slower).
using Sums = __m512[2];
template <int MB, typename Step>
static inline void in_registers(int64_t steps, float* acc, Step&& step) {
  Sums a[MB];
  for (int m = 0; m < MB; ++m) { a[m][0] = _mm512_setzero_ps(); a[m][1] = _mm512_setzero_ps(); }
  for (int64_t i = 0; i < steps; ++i) step(a, i);
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(acc + m * NB, a[m][0]);
    _mm512_storeu_ps(acc + m * NB + 16, a[m][1]);
  }
}

// Every row's x[m, k] times the block's k-th 32 weights (w0, w1), added to its sums.
template <int MB>
static inline void add_rows(Sums* a, const float* x, int64_t xs, int64_t k, __m512 w0, __m512 w1) {
  for (int m = 0; m < MB; ++m) {
    const __m512 xv = _mm512_set1_ps(x[m * xs + k]);
    a[m][0] = _mm512_fmadd_ps(xv, w0, a[m][0]);
    a[m][1] = _mm512_fmadd_ps(xv, w1, a[m][1]);
  }
}

// Step i's 128 bytes of the next block (`next`, nullptr for none), asked for into L2 during a block's last pass.
static inline void ask_next(const void* next, int64_t i) {
  if (next == nullptr) return;
  const char* p = static_cast<const char*>(next) + i * 128;
  _mm_prefetch(p, _MM_HINT_T1);
  _mm_prefetch(p + 64, _MM_HINT_T1);
}
template <int MB, bool Ahead>
static inline void block_f32(const float* x, int64_t xs, int64_t K, const float* w, float* acc,
                             const void* next = nullptr) {
  in_registers<MB>(K, acc, [&](Sums* a, int64_t k) {
    ask_next(next, k);
    if constexpr (Ahead) ask_ahead(w + (k + F32_AHEAD) * NB);
    add_rows<MB>(a, x, xs, k, _mm512_loadu_ps(w + k * NB), _mm512_loadu_ps(w + k * NB + 16));
  });
}
#elif defined(SHARDMESH_AVX2)
// A row's 32 sums are four 8-wide registers, so of AVX2's sixteen three rows' fit beside the weights: rows are taken
// three (or two) at a time, and a pass of more rows reads the block again from L1/L2 for each three (the plain loop
// below keeps its a[MB][NB] sums in memory instead). `step(a, i)` adds step i's products, as on AVX-512.
using Sums = __m256[4];
template <int R, typename Step>
static inline void in_registers(int64_t steps, float* acc, Step&& step) {
  Sums a[R];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) a[m][j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) step(a, i);
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + m * NB + 8 * j, a[m][j]);
}

// chunk(m, R) for rows m, m + 1 (R = 2) of MB, then the last (R = 1) when MB is odd.
template <int MB, typename Chunk>
static inline void in_pairs(Chunk&& chunk) {
  int m = 0;
  for (; m + 2 <= MB; m += 2) chunk(m, std::integral_constant<int, 2>{});
  if constexpr (MB % 2 == 1) chunk(MB - 1, std::integral_constant<int, 1>{});
}
// chunk(m, R) for rows m .. m + 2 (R = 3) of MB, then the last two or one.
template <int MB, typename Chunk>
static inline void in_threes(Chunk&& chunk) {
  int m = 0;
  for (; m + 3 <= MB; m += 3) chunk(m, std::integral_constant<int, 3>{});
  if constexpr (MB % 3 == 2) chunk(MB - 2, std::integral_constant<int, 2>{});
  if constexpr (MB % 3 == 1) chunk(MB - 1, std::integral_constant<int, 1>{});
}

// Input k of R rows (xr, row stride xs) times the block's k-th 32 float32 weights, added to their sums.
template <int R>
static inline void f32_step(Sums* a, const float* xr, int64_t xs, const float* w, int64_t k) {
  const float* wk = w + k * NB;
  __m256 xv[R];
  for (int m = 0; m < R; ++m) xv[m] = _mm256_broadcast_ss(xr + m * xs + k);
  for (int j = 0; j < 4; ++j) {
    const __m256 wj = _mm256_loadu_ps(wk + 8 * j);
    for (int m = 0; m < R; ++m) a[m][j] = _mm256_fmadd_ps(xv[m], wj, a[m][j]);
  }
}

// Inputs 2p, 2p + 1 of R rows times the block's p-th 32 bfloat16 pairs, widened in registers as the AVX-512 path
// without its bfloat16 instructions does: each uint32 holds (w[n, k], w[n, k + 1]); shifting and masking gives both.
template <int R>
static inline void bf16_step(Sums* a, const float* xr, int64_t xs, int64_t K, const uint16_t* w, int64_t p) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t k = 2 * p;
  __m256 x0[R], x1[R];
  for (int m = 0; m < R; ++m) {
    x0[m] = _mm256_broadcast_ss(xr + m * xs + k);
    x1[m] = _mm256_set1_ps(k + 1 < K ? xr[m * xs + k + 1] : 0.f);
  }
  for (int j = 0; j < 4; ++j) {
    const __m256i pj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * NB + 16 * j));
    const __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(pj, 16));  // w[n, k] for 8 outputs n
    const __m256 o = _mm256_castsi256_ps(_mm256_and_si256(pj, high));  // w[n, k + 1]
    for (int m = 0; m < R; ++m) a[m][j] = _mm256_fmadd_ps(x1[m], o, _mm256_fmadd_ps(x0[m], e, a[m][j]));
  }
}

// No prefetch here (`Ahead` is ignored): on a Zen 3 (family 25 model 1) the AVX-512 path's 4 KiB ahead made one row's
// products over all of SmolLM2's layers 4-6% slower (18.4-18.7 against 17.6-17.9 ms, alternated, three runs).
template <int MB, bool Ahead>
static inline void block_f32(const float* x, int64_t xs, int64_t K, const float* w, float* acc,
                             const void* = nullptr) {
  in_threes<MB>([&](int m0, auto rows) {
    constexpr int R = decltype(rows)::value;
    in_registers<R>(K, acc + m0 * NB, [&](Sums* a, int64_t k) { f32_step<R>(a, x + m0 * xs, xs, w, k); });
  });
}

// `Ahead`: the first pass over a block asks for its pairs F32_AHEAD on (4 KiB) into L1 (`ask_ahead`), as the AVX-512
// path does. Here float32's blocks are better without (above), but SmolLM2's bfloat16 products from memory at one row
// took 0.90x the time with it on the Zen 3 (0.84-0.96, three builds alternated 4 times).
template <int MB, bool Ahead = false>
static inline void block_bf16(const float* x, int64_t xs, int64_t K, const uint16_t* w, float* acc) {
  in_threes<MB>([&](int m0, auto rows) {
    constexpr int R = decltype(rows)::value;
    in_registers<R>((K + 1) / 2, acc + m0 * NB, [&](Sums* a, int64_t p) {
      if (Ahead && m0 == 0) ask_ahead(w + (p + F32_AHEAD) * 2 * NB);
      bf16_step<R>(a, x + m0 * xs, xs, K, w, p);
    });
  });
}

#else
// Without AVX-512 or AVX2: the compiler vectorizes the NB-wide loop.
template <int MB>
static inline void block_generic(const float* x, int64_t xs, int64_t K, const float* w, float* acc) {
  float a[MB][NB] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * NB;
    for (int m = 0; m < MB; ++m) {
      const float xv = x[m * xs + k];
#pragma omp simd
      for (int j = 0; j < NB; ++j) a[m][j] += xv * wk[j];
    }
  }
  std::memcpy(acc, a, sizeof(a));
}

template <int MB, bool Ahead>
static inline void block_f32(const float* x, int64_t xs, int64_t K, const float* w, float* acc,
                             const void* = nullptr) {
  block_generic<MB>(x, xs, K, w, acc);
}
#endif

// Pairs per chunk of the chunked products (`over_chunks`): 4 KiB of a block's weights, in L1 while every row group
// passes over it.
constexpr int64_t CHUNK = 32;

#ifdef __AVX512F__
// Pair p (inputs k = 2p, k + 1) of MB rows times the block's p-th 32 pairs, widened in registers, added to their sums:
// each uint32 holds (w[n, k], w[n, k + 1]); shifting gives the first, masking the second. k + 1 is added first.
template <int MB>
static inline void widened_step(Sums* a, const float* x, int64_t xs, int64_t K, const uint16_t* w, int64_t p) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const int64_t k = 2 * p;
  const __m512i p0 = _mm512_loadu_si512(w + k * NB), p1 = _mm512_loadu_si512(w + k * NB + 32);
  const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));  // w[n, k] for n of the first half
  const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(p0, high));  // w[n, k + 1]
  const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
  const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
  for (int m = 0; m < MB; ++m) {
    const __m512 x0 = _mm512_set1_ps(x[m * xs + k]), x1 = _mm512_set1_ps(k + 1 < K ? x[m * xs + k + 1] : 0.f);
    a[m][0] = _mm512_fmadd_ps(x0, e0, _mm512_fmadd_ps(x1, o0, a[m][0]));
    a[m][1] = _mm512_fmadd_ps(x0, e1, _mm512_fmadd_ps(x1, o1, a[m][1]));
  }
}

// bfloat16 weights widened to float32 in registers: each uint32 of a block row holds the pair (w[n, k], w[n, k + 1]);
// shifting and masking gives both. AVX-512 without its bfloat16 instructions takes it for every product; with them,
// for products of several rows where vdpbf16ps is the slower way (`bf16_rows_widened`). Input k + 1 is added first and
// k second, vdpbf16ps's order: with x rounded to bfloat16, each product is exact in float32 and each FMA rounds one
// sum as vdpbf16ps does, so the two give the same numbers (up to denormals, which vdpbf16ps takes as zero).
template <int MB, bool Ahead = false>
static inline void block_bf16(const float* x, int64_t xs, int64_t K, const uint16_t* w, float* acc,
                              const void* next = nullptr) {
  in_registers<MB>((K + 1) / 2, acc, [&](Sums* a, int64_t p) {
    ask_next(next, p);
    if constexpr (Ahead) ask_ahead(w + (p + F32_AHEAD) * 2 * NB);
    widened_step<MB>(a, x, xs, K, w, p);
  });
}

// How far ahead the chunked products ask for weights, in pairs (16 KiB), into L2: each row group's pass over a chunk
// asks for half the lines of the chunk that far on, a line per pair (`share`: 0 the first half, 1 the second; the
// groups alternate, so every line is asked for), so the requests go out at an even pace while all the rows'
// multiply-adds run. Asked for all at once by the first group, 4 KiB on into L1 (block_bf16's way), half the time of
// that group's pass waited on the loads of its weights (`perf annotate`). On the Xeon of family 6 model 207, a SmolLM2
// decode step of 16 rows in bfloat16 took 0.88x the time (20.7-21.1 against 23.2-24.0 ms, 3 alternated rounds);
// into L1 at 4 KiB 0.90x, into L2 at 32 KiB the same as at 16.
constexpr int64_t CHUNK_AHEAD = 4 * CHUNK;

// Pairs [p0, p1) of a block for MB rows, their sums carried in acc (MB x NB) from the chunk before (`fresh`: from
// zero): block_bf16's steps, a chunk at a time, so that every row group can take the chunk while it is in L1; the
// group asks for its `share` of the weights CHUNK_AHEAD pairs on.
template <int MB>
static inline void chunk_bf16(const float* x, int64_t xs, int64_t K, const uint16_t* w, int64_t p0, int64_t p1,
                              int share, float* acc, bool fresh) {
  Sums a[MB];
  for (int m = 0; m < MB; ++m) {
    a[m][0] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + m * NB);
    a[m][1] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + m * NB + 16);
  }
  // pair p's 128 bytes are two lines: half a chunk's lines is as many as its pairs
  const char* ahead = reinterpret_cast<const char*>(w + (p0 + CHUNK_AHEAD) * 2 * NB) + share * CHUNK * 64;
  for (int64_t p = p0; p < p1; ++p) {
    _mm_prefetch(ahead + (p - p0) * 64, _MM_HINT_T1);
    widened_step<MB>(a, x, xs, K, w, p);
  }
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(acc + m * NB, a[m][0]);
    _mm512_storeu_ps(acc + m * NB + 16, a[m][1]);
  }
}
#elif !defined(SHARDMESH_AVX2)
template <int MB>
static inline void block_bf16(const float* x, int64_t xs, int64_t K, const uint16_t* w, float* acc) {
  float a[MB][NB] = {};
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* wk = w + k * NB;  // NB pairs (w[n, k], w[n, k + 1])
    for (int m = 0; m < MB; ++m) {
      const float x0 = x[m * xs + k], x1 = k + 1 < K ? x[m * xs + k + 1] : 0.f;
#pragma omp simd
      for (int j = 0; j < NB; ++j) a[m][j] += x0 * bf2f(wk[2 * j]) + x1 * bf2f(wk[2 * j + 1]);
    }
  }
  std::memcpy(acc, a, sizeof(a));
}
#endif

// int8 weights: block b holds w[b*NB + j, k] at [b][k][j], as float32's, each widened to float32 in registers. A
// weight is (q + 128) s + m with its group's float16 scale s and minimum m, so over a group of GROUP inputs
// sum_k x[k] w[k] = s sum_k x[k] q[k] + (m + 128 s) sum_k x[k]: each group's sums are kept apart, then scaled and
// added with the offset m + 128 s times the group's inputs' sum (xsum, per row and group). `so` is the block's
// (groups, 2, NB) scales and minima (`pack_groups`).
constexpr int64_t GROUP = @GROUP@;
// int8 weights are read at a quarter of float32's bytes per product, slowly enough that the CPU's own prefetch lets
// the loop wait on memory: asking for the weights I8_AHEAD inputs on (8 KiB; a 64-byte line every two inputs), into
// L2, took SmolLM2's layers from 27-33 to 35-37 GB/s of int8 on 2 Zen 5 cores, where the weights in cache give 68.
// The same for float32's blocks changed nothing there; on an Intel Xeon a shorter distance did (F32_AHEAD). The
// AVX2 loop keeps it: on a Zen 3, SmolLM2's int8 products over 30 layers took 1.035x the time without it at one row
// and 1.009x at 16 (alternated in one process, 15 rounds).
constexpr int64_t I8_AHEAD = 256;
#ifdef __AVX512F__
template <int MB>
static inline void block_i8(const float* x, int64_t xs, int64_t K, const int8_t* w, const at::Half* so,
                            const float* xsum, float* acc) {
  const int64_t groups = (K + GROUP - 1) / GROUP;
  const __m512 c128 = _mm512_set1_ps(128.f);
  Sums a[MB];
  for (int m = 0; m < MB; ++m) { a[m][0] = _mm512_setzero_ps(); a[m][1] = _mm512_setzero_ps(); }
  // Few rows have few sums to add to: with U sets of them, inputs k and k + 1 add to different ones, so the adds
  // of one row are not each waiting for the last (an FMA's latency, four cycles, per 32 weights with one set).
  constexpr int U = MB <= 2 ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    Sums t[U][MB];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < MB; ++m) { t[u][m][0] = _mm512_setzero_ps(); t[u][m][1] = _mm512_setzero_ps(); }
    auto add = [&](Sums* sums, int64_t k) {
      const __m128i* wk = reinterpret_cast<const __m128i*>(w + k * NB);
      if ((k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + I8_AHEAD) * NB), _MM_HINT_T1);
      add_rows<MB>(sums, x, xs, k, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wk))),
                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(wk + 1))));
    };
    const int64_t end = std::min(K, g * GROUP + GROUP);
    int64_t k = g * GROUP;
    for (; k + U <= end; k += U)
      for (int u = 0; u < U; ++u) add(t[u], k + u);
    for (; k < end; ++k) add(t[0], k);
    for (int u = 1; u < U; ++u)
      for (int m = 0; m < MB; ++m) {
        t[0][m][0] = _mm512_add_ps(t[0][m][0], t[u][m][0]);
        t[0][m][1] = _mm512_add_ps(t[0][m][1], t[u][m][1]);
      }
    const __m256i* p = reinterpret_cast<const __m256i*>(so + g * 2 * NB);
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(p)), s1 = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
    const __m512 o0 = _mm512_fmadd_ps(s0, c128, _mm512_cvtph_ps(_mm256_loadu_si256(p + 2)));
    const __m512 o1 = _mm512_fmadd_ps(s1, c128, _mm512_cvtph_ps(_mm256_loadu_si256(p + 3)));
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(xsum[m * groups + g]);
      a[m][0] = _mm512_fmadd_ps(t[0][m][0], s0, _mm512_fmadd_ps(xv, o0, a[m][0]));
      a[m][1] = _mm512_fmadd_ps(t[0][m][1], s1, _mm512_fmadd_ps(xv, o1, a[m][1]));
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm512_storeu_ps(acc + m * NB, a[m][0]);
    _mm512_storeu_ps(acc + m * NB + 16, a[m][1]);
  }
}
#elif defined(SHARDMESH_AVX2)
// Two rows at a time (`in_pairs`), each group's sums in registers and the scaled totals in acc.
template <int MB>
static inline void block_i8(const float* x, int64_t xs, int64_t K, const int8_t* w, const at::Half* so,
                            const float* xsum, float* acc) {
  const int64_t groups = (K + GROUP - 1) / GROUP;
  const __m256 c128 = _mm256_set1_ps(128.f);
  std::fill(acc, acc + MB * NB, 0.f);
  in_pairs<MB>([&](int m0, auto rows) {
    constexpr int R = decltype(rows)::value;
    const float* xr = x + m0 * xs;
    for (int64_t g = 0; g < groups; ++g) {
      Sums t[R];
      for (int m = 0; m < R; ++m)
        for (int j = 0; j < 4; ++j) t[m][j] = _mm256_setzero_ps();
      for (int64_t k = g * GROUP, end = std::min(K, g * GROUP + GROUP); k < end; ++k) {
        if (m0 == 0 && (k & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (k + I8_AHEAD) * NB), _MM_HINT_T1);
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * NB));
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        const __m256 wv[4] = {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))};
        for (int m = 0; m < R; ++m) {
          const __m256 xv = _mm256_broadcast_ss(xr + m * xs + k);
          for (int j = 0; j < 4; ++j) t[m][j] = _mm256_fmadd_ps(xv, wv[j], t[m][j]);
        }
      }
      const __m128i* p = reinterpret_cast<const __m128i*>(so + g * 2 * NB);  // 32 scales, then 32 minima
      for (int j = 0; j < 4; ++j) {
        const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(p + j));
        const __m256 off = _mm256_fmadd_ps(sc, c128, _mm256_cvtph_ps(_mm_loadu_si128(p + 4 + j)));
        for (int m = 0; m < R; ++m) {
          float* a = acc + (m0 + m) * NB + 8 * j;
          const __m256 xv = _mm256_set1_ps(xsum[(m0 + m) * groups + g]);
          _mm256_storeu_ps(a, _mm256_fmadd_ps(t[m][j], sc, _mm256_fmadd_ps(xv, off, _mm256_loadu_ps(a))));
        }
      }
    }
  });
}
#else
template <int MB>
static inline void block_i8(const float* x, int64_t xs, int64_t K, const int8_t* w, const at::Half* so,
                            const float* xsum, float* acc) {
  const int64_t groups = (K + GROUP - 1) / GROUP;
  float a[MB][NB] = {};
  for (int64_t g = 0; g < groups; ++g) {
    float t[MB][NB] = {};
    for (int64_t k = g * GROUP, end = std::min(K, k + GROUP); k < end; ++k) {
      const int8_t* wk = w + k * NB;
      for (int m = 0; m < MB; ++m) {
        const float xv = x[m * xs + k];
#pragma omp simd
        for (int j = 0; j < NB; ++j) t[m][j] += xv * static_cast<float>(wk[j]);
      }
    }
    const at::Half* p = so + g * 2 * NB;
    float sc[NB], off[NB];
    for (int j = 0; j < NB; ++j) {
      sc[j] = static_cast<float>(p[j]);
      off[j] = static_cast<float>(p[NB + j]) + 128.f * sc[j];
    }
    for (int m = 0; m < MB; ++m) {
      const float xv = xsum[m * groups + g];
#pragma omp simd
      for (int j = 0; j < NB; ++j) a[m][j] += t[m][j] * sc[j] + xv * off[j];
    }
  }
  std::memcpy(acc, a, sizeof(a));
}
#endif

#ifdef __AVX512BF16__
// x as bfloat16 pairs, one uint32 per (k, k + 1).
template <int MB, bool Ahead = false>
static inline void block_dp(const uint32_t* x, int64_t xs, int64_t K2, const uint16_t* w, float* acc,
                            const void* next = nullptr) {
  in_registers<MB>(K2, acc, [&](Sums* a, int64_t p) {
    ask_next(next, p);
    if constexpr (Ahead) ask_ahead(w + (p + F32_AHEAD) * 2 * NB);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + p * 2 * NB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + p * 2 * NB + 32);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * xs + p]));
      a[m][0] = _mm512_dpbf16_ps(a[m][0], xv, w0);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], xv, w1);
    }
  });
}
#endif

// y's rows m .. m + rows of block b (outputs b·NB ..., at most N) = acc's (rows x NB) + bias, rounded to bfloat16 when
// `round_bf16`.
static inline void store_block(float* y, int64_t N, int64_t b, int64_t m, int rows, const float* acc, const float* bias,
                               bool round_bf16) {
  const int64_t n0 = b * NB, nn = std::min(NB, N - n0);
  int64_t j = 0;
#ifdef SHARDMESH_LANES
  for (; j + L <= nn; j += L) {
    const Lanes bj = bias ? vload(bias + n0 + j) : vset(0.f);
    for (int i = 0; i < rows; ++i)
      vput(y + (m + i) * N + n0 + j, vround(round_bf16, vadd(vload(acc + i * NB + j), bj)));
  }
#endif
  for (int i = 0; i < rows; ++i)
    for (int64_t t = j; t < nn; ++t) {  // the last block's outputs short of a vector (past N: padding, not stored)
      y[(m + i) * N + n0 + t] = round_to(round_bf16, acc[i * NB + t] + (bias ? bias[n0 + t] : 0.f));
    }
}

#ifdef SHARDMESH_AMX
// bfloat16 products on AMX tiles, where the CPU has them. vdpbf16ps multiplies 32 weights by one row's pair per
// instruction, so 16 rows take 16 instructions per weight register: from a few rows on the product waits on them, not
// on memory (on a Xeon of family 6 model 207 a 16-row decode step took 3x one row's time, and a prefill of 16 x 46
// tokens longer than float32's). One TDPBF16PS multiplies 16 rows by 32 inputs of 16 outputs. The blocked layout is
// already the tiles' operand layout: block b's rows of pairs (k, k + 1) for its 32 outputs are 128 bytes each, so 16
// of them, 128 bytes apart, are the B tile of outputs 0-15, and 64 bytes further those of 16-31; the rows' pairs
// (`xq`) are the A tile. Measured there (bench/bf16_products.py, 2 threads, SmolLM2's products): 0.18-0.36x
// vdpbf16ps's time at 16 rows, 0.24-0.46x at 736 (a prefill); at one row 0.73x for the LM head and 0.92-1.43x for a
// layer's products whose weights sit in cache (a tile configuration per call), about even for a whole step. The same
// numbers up to the order of sums: both sum pairs of bfloat16 products in float32.

// The kernel lets a process use AMX's tile registers only once it asks (Linux 5.16+): once per process, false where
// the kernel or a hypervisor says no, or $@AMX_ENV@ is 0 (the vdpbf16ps path is used then).
static bool amx_permitted() {
  static const bool ok = [] {
    const char* env = std::getenv("@AMX_ENV@");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: the sums of `mb` rows by outputs 0-15 and 16-31 (float32); 2: the rows' 16 pairs; 3, 4: 16 pairs of
// the block's outputs 0-15 and 16-31.
static void configure_tiles(int mb) {
  TileConfig c;
  for (int t : {0, 1, 2}) { c.rows[t] = static_cast<uint8_t>(mb); c.colsb[t] = 64; }
  for (int t : {3, 4}) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// acc (mb x NB) = the rows' pairs xq (row stride K2 pairs) times block w (K2 x NB pairs), K2 a multiple of 16. On a
// block's first pass (`Ahead`: its weights come from memory) each step asks for the weights F32_AHEAD pairs on, as the
// other bfloat16 kernels do (`ask_ahead`): the tile loads alone left the CPU's prefetch behind. On a Xeon of family 6
// model 207 with AMX exposed, a whole SmolLM2 decode step (in process, alternated step by step with the loads alone,
// 40 steps each) took 0.83x the time at one row, 0.85-0.91x at 2 to 16 rows; without it, one-row steps on the tiles
// had taken 1.19x vdpbf16ps's time, and with it 0.99x. 16 and 64 pairs ahead measured as 32 within noise, 128 worse.
template <bool Ahead>
static inline void block_amx(const uint32_t* xq, int64_t K2, const uint16_t* w, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t p = 0; p < K2; p += 16) {
    if constexpr (Ahead)
      for (int i = 0; i < 16; ++i) ask_ahead(w + (p + F32_AHEAD + i) * 2 * NB);
    _tile_loadd(2, xq + p, K2 * 4);
    _tile_loadd(3, w + p * 2 * NB, 2 * NB * 2);
    _tile_loadd(4, w + p * 2 * NB + NB, 2 * NB * 2);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, acc, NB * 4);
  _tile_stored(1, acc + 16, NB * 4);
}
#endif

#ifdef SHARDMESH_AVX2
// float32 products of many rows (a prompt's) on AVX2. Passing over a whole block (72-196 KiB for SmolLM2's widths) for
// every three rows reads it from L2; here the rows' sums for a block are kept in acc (MC x NB) and the block is walked
// KC inputs at a time, each tile's weights (16 KiB) staying in L1 while the rows pass over it. The rows go six at a
// time over half the block (16 outputs): 12 sums, 2 weight registers and 1 input register of the 16, and per input 2
// weight loads and 6 broadcasts for 12 FMAs. Three rows over all 32 outputs (`block_f32`) need all 16 registers, so
// the compiler folds the weight loads into the FMAs: 13 loads per 12 FMAs, and the loads bound the loop. On a Zen 3,
// SmolLM2's four products at 256 rows over 30 layers' weights (alternated in one process, 7 rounds): 495 ms six by 16
// against 559 three by 32 and 532 on oneDNN. Panels of MC rows keep a 512-row prompt's sums in L1 (one run each: 0.85x
// the time of three by 32 there, 0.89x without panels). bfloat16 weights take the same loop once each tile is widened
// to float32 (`tiled`): tiled as pairs, widened in registers for every three rows, they took 22.3 ms a layer against
// 18.4 untiled; widened once per tile for all the rows, a SmolLM2 prefill of 736 rows took 0.93x the untiled time (on
// a Zen 3, the two builds alternated 6 times; 0.83-0.95). Decode steps of 8 rows or more take it too, each pass
// asking for the next tile's weights (`tiled`): SmolLM2's products from memory at 16 rows took 0.90-0.97x the time
// of `over_blocks` in float32 and 0.82-0.88x in bfloat16, at 24 rows 0.86-0.89x and 0.82-0.87x (on the same Zen 3,
// three builds alternated 4 times, twice); at 4 rows they took 1.0-1.05x, and without asking ahead 1.1-1.8x.
constexpr int64_t TILED_ROWS = 8;  // fewer rows take `over_blocks`: up to three passes of three rows over each block
constexpr int64_t KC = 128;        // inputs per tile
constexpr int64_t MC = 96;         // rows per panel: their sums for a block, 12 KiB

// Inputs begin..end of R rows (xr, row stride xs) times 16 of each input's 32 block weights (wh: the block's weights
// from the half's first output), added to the rows' sums for those 16 outputs (acc, row stride NB); the first `lines`
// steps each ask for a line from `ahead` on into L2 (`tiled`'s next tile). Two flat arrays
// of sums, not one of pairs: GCC 12 kept an [R][2] array in registers but stored all of it to the stack every step.
template <int R>
static inline void half_block_f32(int64_t begin, int64_t end, const float* xr, int64_t xs, const float* wh,
                                  float* acc, const char* ahead, int64_t lines) {
  __m256 lo[R], hi[R];
  _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {
    lo[m] = _mm256_loadu_ps(acc + m * NB);
    hi[m] = _mm256_loadu_ps(acc + m * NB + 8);
  }
  for (int64_t k = begin; k < end; ++k) {
    if (k - begin < lines) _mm_prefetch(ahead + (k - begin) * 64, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(wh + k * NB), w1 = _mm256_loadu_ps(wh + k * NB + 8);
    _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xr + m * xs + k);
      lo[m] = _mm256_fmadd_ps(xv, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, w1, hi[m]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < R; ++m) {
    _mm256_storeu_ps(acc + m * NB, lo[m]);
    _mm256_storeu_ps(acc + m * NB + 8, hi[m]);
  }
}

// acc (rows x NB) += rows of xr (row stride xs) times inputs [begin, end) of the half block wh (16 outputs, input
// k's at wh + k * NB): six rows at a time, then the rest; the `lines` lines from `ahead` on are asked for in equal
// parts by the passes.
static inline void half_rows_f32(int64_t rows, int64_t begin, int64_t end, const float* xr, int64_t xs,
                                 const float* wh, float* acc, const char* ahead, int64_t lines) {
  const int64_t passes = (rows + 5) / 6, each = (lines + passes - 1) / passes;
  int64_t m = 0, q = 0;
  auto part = [&](int64_t i) { return ahead + std::min(lines, i * each) * 64; };
  auto count = [&](int64_t i) { return std::max<int64_t>(0, std::min(lines, (i + 1) * each) - i * each); };
  for (; m + 6 <= rows; m += 6, ++q)
    half_block_f32<6>(begin, end, xr + m * xs, xs, wh, acc + m * NB, part(q), count(q));
  const float* xm = xr + m * xs;
  float* rest = acc + m * NB;
  const char* pa = part(q);
  const int64_t pl = count(q);
  switch (rows - m) {
    case 5: half_block_f32<5>(begin, end, xm, xs, wh, rest, pa, pl); break;
    case 4: half_block_f32<4>(begin, end, xm, xs, wh, rest, pa, pl); break;
    case 3: half_block_f32<3>(begin, end, xm, xs, wh, rest, pa, pl); break;
    case 2: half_block_f32<2>(begin, end, xm, xs, wh, rest, pa, pl); break;
    case 1: half_block_f32<1>(begin, end, xm, xs, wh, rest, pa, pl); break;
    default: break;
  }
}
#endif

// f(m, rows) for M rows taken eight at a time, then four, then the rest, rows a compile-time constant.
template <typename F>
static inline void in_row_groups(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) f(m, std::integral_constant<int, 8>{});
  if (M - m >= 4) {
    f(m, std::integral_constant<int, 4>{});
    m += 4;
  }
  switch (M - m) {
    case 3: f(m, std::integral_constant<int, 3>{}); break;
    case 2: f(m, std::integral_constant<int, 2>{}); break;
    case 1: f(m, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// Every block of N, in parallel, times the rows eight (then four) at a time, then the rest: kernel(m, rows, block,
// acc) with rows a compile-time constant (so the accumulators stay in registers), then each result stored.
// Each thread takes a contiguous range of the blocks, one at a time from its front, and a thread done with its own
// takes the others' next blocks, so that none spins at the region's end while blocks remain. Why: a decode step's
// products are short regions (SmolLM2 at one row: 121 a step, ~35-110 us each), and on the Xeon of family 6 model 207
// fixed halves finished 2.5 us (bfloat16) and 7 us (float32) apart on average; which thread finished first changed
// between regions and between processes, so no fixed split removes it. There, against fixed halves (in process, two
// builds alternated 6 rounds): bfloat16 prompts of 16 x 46 tokens 0.98x the time (0.97-0.99, every round), one-row
// steps 0.94x (0.92-1.03); float32 within noise (prompts 1.00x, one row 0.99x, 16 rows 1.00x). Each block is still
// computed whole by one thread, so the numbers are the same to the bit whoever takes it.
struct alignas(64) BlockRange {  // a line each: the threads claim from their own ranges without sharing one
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};
// f(b, acc) for every block b of N outputs, claimed so; acc is the claiming thread's, Rows x NB floats.
template <int64_t Rows = 8, typename F>
static void each_block(int64_t N, F&& f) {
  const int64_t blocks = (N + NB - 1) / NB;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks));
  std::vector<BlockRange> ranges(T);
  for (int64_t t = 0; t < T; ++t) {
    ranges[t].next.store(blocks * t / T, std::memory_order_relaxed);
    ranges[t].end = blocks * (t + 1) / T;
  }
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    float acc[Rows * NB];
    for (int64_t t = t0; t < t1; ++t)  // one each, unless the region runs on fewer threads (inside another)
      for (int64_t k = 0; k < T; ++k) {  // its own range, then the others' in turn
        BlockRange& r = ranges[(t + k) % T];
        for (int64_t b; (b = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) f(b, acc);
      }
  });
}
template <typename F>
static void over_blocks(int64_t M, int64_t N, const float* bias, float* y, bool round_bf16, F&& kernel) {
  each_block(N, [&](int64_t b, float* acc) {
    in_row_groups(M, [&](int64_t m, auto rows) {
      kernel(m, rows, b, acc);
      store_block(y, N, b, m, decltype(rows)::value, acc, bias, round_bf16);
    });
  });
}

// Products of a few more rows than one register pass holds (8 < M <= CHUNKED_ROWS): each block is taken CHUNK
// steps at a time by every group of rows in turn (kernel(m, rows, share, b, p0, p1, acc) for rows m .. m + rows,
// `share` 0 and 1 by turns from the first group, its sums carried in acc between chunks), so that the weights
// stream from memory while all the rows' multiply-adds run, where passes over a whole block waited on memory in the
// first and left it idle in the others. Widened bfloat16 on the Xeon of family 6 model 207 (a SmolLM2 step's
// products, weights from memory, 3 alternated rounds): 0.88x the time at 12 rows, 0.94x at 16. The same for float32
// weights measured no change (36.0-37.2 against 35.1-38.1 ms a 16-row step) and was left out. The blocks are claimed
// as `over_blocks` claims them (`each_block`): with fixed halves, the thread done first spun at each product's end;
// there, against fixed halves, a whole SmolLM2 bfloat16 step through the compiled path took 0.987x the time at 12
// rows, 0.974x at 16 and 0.960x at 24 (in one process, alternated 40 times).
constexpr int64_t CHUNKED_ROWS = 32;
template <typename F>
static void over_chunks(int64_t M, int64_t N, int64_t steps, const float* bias, float* y, bool round_bf16,
                        F&& kernel) {
  each_block<CHUNKED_ROWS>(N, [&](int64_t b, float* acc) {
    for (int64_t p0 = 0; p0 < steps; p0 += CHUNK) {
      const int64_t p1 = std::min(steps, p0 + CHUNK);
      int group = 0;
      in_row_groups(M, [&](int64_t m, auto rows) { kernel(m, rows, group++ & 1, b, p0, p1, acc + m * NB); });
    }
    store_block(y, N, b, 0, static_cast<int>(M), acc, bias, round_bf16);
  });
}

#ifdef SHARDMESH_AVX2
// Inputs [k0, k1) of a bfloat16 block (its pairs as `block_bf16` reads them; k0 even) widened to float32 rows of NB:
// wide[(k - k0) * NB + n] = w[n, k].
static inline void widen_tile(const uint16_t* blk, int64_t k0, int64_t k1, float* wide) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = k0; k < k1; k += 2) {
    float* out = wide + (k - k0) * NB;
    for (int j = 0; j < 4; ++j) {
      const __m256i pj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * NB + 16 * j));
      _mm256_store_ps(out + 8 * j, _mm256_castsi256_ps(_mm256_slli_epi32(pj, 16)));
      if (k + 1 < k1) _mm256_store_ps(out + NB + 8 * j, _mm256_castsi256_ps(_mm256_and_si256(pj, high)));
    }
  }
}

// y (M, N) = x (M, K) times the packed weights wp + bias on AVX2, for M >= TILED_ROWS: blocks claimed as `over_blocks`
// claims them (`each_block`); for each block, panels of MC rows, KC inputs at a time, each half of the block, every
// six rows (`half_rows_f32`). bfloat16 weights (`Widened`) are widened into a float32 tile first, once for all the
// panel's rows, where `block_bf16` widens each pair again for every three rows. Each output's sum is taken input by
// input in the order `block_f32` and `block_bf16` take it, so the results are theirs to the bit.
template <bool Widened>
static void tiled(const float* x, int64_t M, int64_t K, const void* wp, int64_t N, const float* bias, float* y,
                  bool round_bf16) {
  // bytes a weight; a block's inputs (bfloat16's pairs: K padded to even)
  constexpr int64_t bytes = Widened ? 2 : 4;
  const int64_t Kb = Widened ? 2 * ((K + 1) / 2) : K;
  each_block<MC>(N, [&](int64_t b, float* acc) {
    alignas(32) float wide[Widened ? KC * NB : 1];
    const char* blk = static_cast<const char*>(wp) + b * Kb * NB * bytes;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t rows = std::min(MC, M - m0);
      const float* xm = x + m0 * K;
      std::fill(acc, acc + rows * NB, 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        // The next tile (past the block's end, the next block's first) is asked for into L2 while the rows pass over
        // this one, half its lines by each half's passes: without it, decode steps' tiles waited on memory with the
        // cores idle, then the cores ran with memory idle (two tiles ahead measured no better than one).
        const int64_t at = k0 + KC, more = std::max<int64_t>(0, (at < K ? K : K + K) - at);
        const char* ahead = blk + at * NB * bytes;
        const int64_t half = std::min(KC, more) * NB * bytes / 64 / 2;  // lines each half's passes ask for
        if constexpr (Widened) widen_tile(reinterpret_cast<const uint16_t*>(blk), k0, k1, wide);
        for (int h = 0; h < NB; h += 16) {
          const char* mine = ahead + h / 16 * half * 64;
          if constexpr (Widened) half_rows_f32(rows, 0, k1 - k0, xm + k0, K, wide + h, acc + h, mine, half);
          else half_rows_f32(rows, k0, k1, xm, K, reinterpret_cast<const float*>(blk) + h, acc + h, mine, half);
        }
      }
      store_block(y, N, b, m0, static_cast<int>(rows), acc, bias, round_bf16);
    }
  });
}
#endif

#ifdef __AVX512BF16__
// The M rows of x (M, K) as bfloat16 pairs, one uint32 per (k, k + 1), K padded to even with a zero: what vdpbf16ps
// and AMX's tiles read (exact where x holds bfloat16 values).
static std::vector<uint32_t> bf16_pairs(const float* x, int64_t M, int64_t K) {
  const int64_t K2 = (K + 1) / 2;
  std::vector<uint32_t> xq(M * K2);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t p = 0; p < K2; ++p) {
      const uint32_t lo = f2bf(x[m * K + 2 * p]), hi = 2 * p + 1 < K ? f2bf(x[m * K + 2 * p + 1]) : 0u;
      xq[m * K2 + p] = lo | (hi << 16);
    }
  return xq;
}
#endif

// Whether bfloat16 products of K2 pairs go to AMX's tiles: where the CPU has them and may use them, and K2 % 16 == 0
// (a tile takes 16 pairs: any Llama width, and its tensor-parallel slices).
static inline bool amx_taken(int64_t K2) {
#ifdef SHARDMESH_AMX
  return K2 % 16 == 0 && amx_permitted();
#else
  (void)K2;
  return false;
#endif
}

// How bfloat16 products of two rows or more run on AVX512-BF16 without AMX: false, vdpbf16ps; true, the weights
// widened for FMAs (`block_bf16`). Which is faster depends on the core: on a Xeon of family 6 model 207, 16-row
// products took vdpbf16ps's twice the cycles of FMAs on the same multiply-adds, where a Zen 4 runs vdpbf16ps at twice
// the FMAs' rate. `bf16_rows_probe` times both, and the loader sets the faster (`cpu_kernels.choose_bf16_rows`). One
// row keeps vdpbf16ps: it waits on memory, with half the instructions.
static std::atomic<bool> bf16_rows_widened{false};

// The ways bfloat16 products of several rows can run in this build on this CPU, the first taken when it applies.
std::vector<std::string> bf16_rows_ways() {
  std::vector<std::string> ways;
#ifdef SHARDMESH_AMX
  if (amx_permitted()) ways.push_back("amx");
#endif
#ifdef __AVX512BF16__
  ways.push_back("vdpbf16ps");
#endif
  ways.push_back("widened");
  return ways;
}

// The way products of several rows take where AMX does not apply: "vdpbf16ps" or "widened".
std::string bf16_rows() {
#ifdef __AVX512BF16__
  return bf16_rows_widened.load() ? "widened" : "vdpbf16ps";
#else
  return "widened";
#endif
}

void set_bf16_rows(std::string way) {
#ifdef __AVX512BF16__
  TORCH_CHECK(way == "vdpbf16ps" || way == "widened", "bfloat16 rows: vdpbf16ps or widened, not ", way);
  bf16_rows_widened.store(way == "widened");
#else
  TORCH_CHECK(way == "widened", "this build has no vdpbf16ps: bfloat16 products are widened, not ", way);
#endif
}

// Nanoseconds per pass of 8 rows over one block of K2 pairs held in L1, by vdpbf16ps and widened, each the least of
// `trials` alternated timings of `passes` passes on this thread: the cores' rate of each, without memory's.
std::vector<double> bf16_rows_probe(int64_t K2, int64_t passes, int64_t trials) {
#ifdef __AVX512BF16__
  constexpr int R = 8;
  const int64_t K = 2 * K2;
  std::vector<uint16_t> w(K2 * 2 * NB);
  std::vector<float> x(R * K), acc(R * NB);
  for (size_t i = 0; i < w.size(); ++i) w[i] = f2bf(1.f + 0.001f * static_cast<float>(i % 97));
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf2f(f2bf(0.01f * static_cast<float>(i % 89)));
  const std::vector<uint32_t> xq = bf16_pairs(x.data(), R, K);
  double best[2] = {1e300, 1e300};
  float sink = 0.f;
  for (int64_t t = 0; t < trials; ++t)
    for (int way = 0; way < 2; ++way) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < passes; ++i) {
        if (way == 0) block_dp<R>(xq.data(), K2, K2, w.data(), acc.data());
        else block_bf16<R>(x.data(), K, K, w.data(), acc.data());
        sink += acc[i % (R * NB)];
      }
      const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      best[way] = std::min(best[way], ns / static_cast<double>(passes));
    }
  static volatile float keep;  // the sums are used, so the passes are not optimized away
  keep = sink;
  return {best[0], best[1]};
#else
  (void)K2; (void)passes; (void)trials;
  TORCH_CHECK(false, "this build has no vdpbf16ps to time");
  return {};
#endif
}

// The block after b (at `after`) when rows [.., end) are the last pass of several over b, else nullptr: a pass after
// the first reads b from L1/L2 and leaves memory idle, so it asks for the next block meanwhile (`ask_next`). On the
// Xeon of family 6 model 207, a SmolLM2 decode step of 16 rows took 0.95x the time in float32 (36.0 against 38.2 ms)
// and 0.99x in bfloat16 (3 alternated rounds of 20 steps).
static inline const void* next_block(int64_t M, int64_t N, int64_t end, int64_t b, const void* after) {
  return end == M && b + 1 < (N + NB - 1) / NB ? after : nullptr;
}

#ifdef __AVX512F__
// y (M, N) = rows xr (M, K), as they are, times bfloat16 weights wp (packed) widened for FMAs: 9 to CHUNKED_ROWS rows a
// chunk of each block at a time by every row group (`over_chunks`), others a block at a time, the first row group
// asking for its weights ahead and the last for the next block (`block_bf16`, `next_block`).
static void widened_products(const float* xr, int64_t M, int64_t K, int64_t N, const uint16_t* wp, const float* bias,
                             float* y, bool round_bf16) {
  const int64_t K2 = (K + 1) / 2;
  if (M > 8 && M <= CHUNKED_ROWS) {
    over_chunks(M, N, K2, bias, y, round_bf16, [&](int64_t m, auto rows, int share, int64_t b, int64_t p0, int64_t p1,
                                                   float* acc) {
      chunk_bf16<decltype(rows)::value>(xr + m * K, K, K, wp + b * K2 * 2 * NB, p0, p1, share, acc, p0 == 0);
    });
    return;
  }
  over_blocks(M, N, bias, y, round_bf16, [&](int64_t m, auto rows, int64_t b, float* acc) {
    constexpr int R = decltype(rows)::value;
    const uint16_t* blk = wp + b * K2 * 2 * NB;
    if (m == 0) block_bf16<R, true>(xr + m * K, K, K, blk, acc);
    else block_bf16<R>(xr + m * K, K, K, blk, acc, next_block(M, N, m + R, b, blk + K2 * 2 * NB));
  });
}
#endif

// y (M, N) float32 = x (M, K) float32 times the packed w, (N, K) as `pack` returns it (int8 weights with `scale`, their
// groups' scales and offsets as `pack_groups` returns them), + bias. `round_bf16`: the activations are bfloat16, so x
// holds bfloat16 values (callers pass a bfloat16 tensor's, or rows they rounded as the model rounds) and each result
// is rounded to bfloat16.
static void gemm(const float* x, int64_t M, int64_t K, const torch::Tensor& w, const at::Half* scale, const float* bias,
                 float* y, bool round_bf16) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K, "packed weight of ", w.sizes(), " for rows of ", K);
  const int64_t N = w.size(0);
  if (w.scalar_type() == at::kFloat) {
    const float* wp = w.data_ptr<float>();
#ifdef SHARDMESH_AVX2
    if (M >= TILED_ROWS) {
      tiled<false>(x, M, K, wp, N, bias, y, round_bf16);
      return;
    }
#endif
    over_blocks(M, N, bias, y, round_bf16, [&](int64_t m, auto rows, int64_t b, float* acc) {
      constexpr int R = decltype(rows)::value;
      const float* blk = wp + b * K * NB;
      if (m == 0) block_f32<R, true>(x + m * K, K, K, blk, acc);
      else block_f32<R, false>(x + m * K, K, K, blk, acc, next_block(M, N, m + R, b, blk + K * NB));
    });
    return;
  }
  if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(scale != nullptr, "int8 weights need their scales");
    const int8_t* wp = w.data_ptr<int8_t>();
    const int64_t groups = (K + GROUP - 1) / GROUP;
    std::vector<float> xsum(M * groups, 0.f);  // each row's sum of inputs per group, for the offsets
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / GROUP] += x[m * K + k];
    over_blocks(M, N, bias, y, round_bf16, [&](int64_t m, auto rows, int64_t b, float* acc) {
      block_i8<decltype(rows)::value>(x + m * K, K, K, wp + b * K * NB, scale + b * groups * 2 * NB,
                                      xsum.data() + m * groups, acc);
    });
    return;
  }
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "packed weights must be float32, bfloat16 or int8");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t K2 = (K + 1) / 2;
#ifdef __AVX512BF16__
  if (M >= 2 && bf16_rows_widened.load(std::memory_order_relaxed) && !amx_taken(K2)) {
    // The rows rounded to bfloat16, as vdpbf16ps reads them (`block_bf16`). Rows that are bfloat16 activations
    // (`round_bf16`: a bfloat16 model's, every caller's) hold bfloat16 values already and are read as they are: their
    // copy and rounding were ~0.5 ms of a 16-row SmolLM2 step, on the calling thread while the other waited.
    Scratch rounded;
    const float* xr = x;
    if (!round_bf16) {
      rounded = scratch(M * K);
      std::copy(x, x + M * K, rounded.get());
      round_all(true, rounded.get(), M * K);
      xr = rounded.get();
    }
    widened_products(xr, M, K, N, wp, bias, y, round_bf16);
    return;
  }
  const std::vector<uint32_t> xq = bf16_pairs(x, M, K);
#ifdef SHARDMESH_AMX
  if (amx_taken(K2)) {
    at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
      float acc[16 * NB];
      int configured = 0;
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t m = 0; m < M; m += 16) {
          const int mb = static_cast<int>(std::min<int64_t>(16, M - m));
          if (mb != configured) { configure_tiles(mb); configured = mb; }
          const uint16_t* blk = wp + b * K2 * 2 * NB;
          if (m == 0) block_amx<true>(xq.data() + m * K2, K2, blk, acc);
          else block_amx<false>(xq.data() + m * K2, K2, blk, acc);
          store_block(y, N, b, m, mb, acc, bias, round_bf16);
        }
      if (configured) _tile_release();  // no tile state left for the kernel to save at each switch
    });
    return;
  }
#endif
  over_blocks(M, N, bias, y, round_bf16, [&](int64_t m, auto rows, int64_t b, float* acc) {
    constexpr int R = decltype(rows)::value;
    const uint16_t* blk = wp + b * K2 * 2 * NB;
    if (m == 0) block_dp<R, true>(xq.data() + m * K2, K2, K2, blk, acc);
    else block_dp<R>(xq.data() + m * K2, K2, K2, blk, acc, next_block(M, N, m + R, b, blk + K2 * 2 * NB));
  });
#elif defined(__AVX512F__)
  // AVX-512 without its bfloat16 instructions (Skylake-SP to Ice Lake servers, or a guest not shown them): every
  // product widened, with the widened way's prefetches and chunks above (the rows as they are: no vdpbf16ps to agree
  // with). Until 2026-12-01 this path asked for nothing ahead and took no chunks; on a Xeon of family 6 model 207 whose
  // guest shows neither AVX512-BF16 nor AMX, a one-row SmolLM2 step took 18.3 ms in bfloat16 against 25.7 in float32,
  // 0.71x the time for half the bytes (docs/performance.md, "bfloat16 without its instructions").
  widened_products(x, M, K, N, wp, bias, y, round_bf16);
#else
#ifdef SHARDMESH_AVX2
  if (M >= TILED_ROWS) {
    tiled<true>(x, M, K, wp, N, bias, y, round_bf16);
    return;
  }
#endif
  over_blocks(M, N, bias, y, round_bf16, [&](int64_t m, auto rows, int64_t b, float* acc) {
#ifdef SHARDMESH_AVX2
    if (m == 0) block_bf16<decltype(rows)::value, true>(x + m * K, K, K, wp + b * K2 * 2 * NB, acc);
    else
#endif
    block_bf16<decltype(rows)::value>(x + m * K, K, K, wp + b * K2 * 2 * NB, acc);
  });
#endif
}

using Opt = c10::optional<torch::Tensor>;

static torch::Tensor as_float(const torch::Tensor& t) { return t.to(torch::kFloat).contiguous(); }
// int8 products' packed float16 scales and minima (`pack_groups`), nullptr for float ones.
static const at::Half* groups_ptr(const Opt& t) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(2) == 2,
              "int8 scales must be float16 (N, groups, 2) as pack_groups returns them, not ", t->sizes());
  return t->data_ptr<at::Half>();
}
static const float* opt_ptr(const Opt& t, torch::Tensor& keep) {
  if (!t.has_value() || !t->defined()) return nullptr;
  keep = as_float(*t);
  return keep.data_ptr<float>();
}

#ifdef SHARDMESH_AVX2
// The sum and the largest of 8 lanes.
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
// The first min(left, 8) lanes, for masked loads and stores of a row's tail.
static inline __m256i lanes8(int64_t left) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// e^x for 8 floats, exp16's arithmetic (below) step for step; 2^n, which AVX2 cannot scale by in one instruction, is
// applied as two powers of two built in the exponent field, each within the normal range for any n of the clamped x
// (-150 to 128), so that the very negative x of a softmax still round to the same denormal or zero.
static inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);  // p * f1 exact (p ~ 1, f1 >= 2^-75); one rounding after
}
#endif

// The index of a row's first largest value, as torch.argmax gives it (a NaN counts as the largest: its first one).
// torch's CPU argmax compares one value at a time: 86 µs for SmolLM2's 49152 logits and 0.70 ms for 16 rows on a
// Xeon of family 6 model 207, where a pass for the maximum and one for its first index take 8 and 113 µs.
static int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float best = -INFINITY;
#ifdef __AVX512F__
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (nan == 0) {
    best = _mm512_reduce_max_ps(top);
    for (int64_t j = i; j < n; ++j) {
      if (x[j] != x[j]) return j;  // not before i: no NaN there
      best = std::max(best, x[j]);
    }
    const __m512 b = _mm512_set1_ps(best);
    for (int64_t j = 0; j + 16 <= n; j += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), b, _CMP_EQ_OQ);
      if (hit) return j + __builtin_ctz(hit);
    }
    for (int64_t j = n - n % 16; j < n; ++j) if (x[j] == best) return j;
  }
#elif defined(SHARDMESH_AVX2)
  __m256 top = _mm256_set1_ps(-INFINITY);
  int nan = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  if (nan == 0) {
    best = hmax8(top);
    for (int64_t j = i; j < n; ++j) {
      if (x[j] != x[j]) return j;  // not before i: no NaN there
      best = std::max(best, x[j]);
    }
    const __m256 b = _mm256_set1_ps(best);
    for (int64_t j = 0; j + 8 <= n; j += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
      if (hit) return j + __builtin_ctz(hit);
    }
    for (int64_t j = n - n % 8; j < n; ++j) if (x[j] == best) return j;
  }
#endif
  // No vector path, or a NaN somewhere: the plain loop, which returns the first NaN.
  int64_t at = 0;
  best = x[0];
  if (best != best) return 0;
  for (i = 1; i < n; ++i) {
    if (x[i] != x[i]) return i;
    if (x[i] > best) { best = x[i]; at = i; }
  }
  return at;
}

#ifdef __AVX512F__
// e^x for 16 floats: x = n ln2 + r, e^r by Cephes' degree-6 polynomial (about 1 ulp from the correctly rounded
// value), times 2^n by vscalefps, which gives 0 for the very negative x that softmax produces; the scalar exp of the
// math library ran 1 to 3 k times per layer here, one call each.
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// log(sum(exp(x - x[at]))) of a row whose largest value is x[at] (argmax_row's: a NaN if the row has one), so
// that any entry's log-probability is (its value - x[at]) - this, as log_softmax computes it, without writing the
// row's log_softmax. NaN where x[at] is not finite: log_softmax's row is all NaN then.
static float logsum_row(const float* x, int64_t n, int64_t at) {
  const float top = x[at];
  if (!std::isfinite(top)) return NAN;
  int64_t i = 0;
  double sum = 0.0;
#ifdef __AVX512F__
  const __m512 t = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), t)));
  sum = _mm512_reduce_add_ps(acc);
#elif defined(SHARDMESH_AVX2)
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), t)));
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) sum += std::exp(x[i] - top);
  return static_cast<float>(std::log(sum));
}

// Greedy sampling's numbers for each row: its argmax, its maximum and the log of its exponentials' sum (the argmax's
// log-probability is minus the last), where torch
// took a log_softmax writing the whole row and a gather (sampling 16 rows of SmolLM2's 49152 logits: 0.16 ms warm
// and 0.43 cold against 0.58 and 1.02).
std::vector<torch::Tensor> greedy_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "greedy_rows: x must be (rows, n > 0) float32, not ", x.sizes(), " ", x.scalar_type());
  auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto ids = torch::empty({rows}, torch::kLong);
  auto top = torch::empty({rows}, torch::kFloat), logsum = torch::empty({rows}, torch::kFloat);
  const float* p = xc.data_ptr<float>();
  int64_t* o = ids.data_ptr<int64_t>();
  float *m = top.data_ptr<float>(), *l = logsum.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      o[r] = argmax_row(p + r * n, n);
      m[r] = p[r * n + o[r]];
      l[r] = logsum_row(p + r * n, n, o[r]);
    }
  });
  return {ids, top, logsum};
}

// Sampled draws (`sampling.draw`, its definition): each row's logits over its temperature, z; the tokens top-k keeps
// (z at least the k-th largest, ties kept); their weights e = exp(z - max z) in float32; top-p keeps the most likely
// in order of z (ties: the lower id first) while the weight ranked above a token is below top_p of the whole;
// min-p keeps e >= min_p (the largest weight is 1); the draw is the first kept token, in id order, whose running sum
// of weights (float64) passes u times their sum, u the row's uniform. torch's sort, softmax and multinomial (a fresh
// generator per row, an exponential draw per token) took 1.6 ms a row at temperature 1 and 5.9 with top-p on
// SmolLM2's 49152 logits; here the passes are linear, and the top-k and top-p cuts search only the tokens above a floor
// that holds them (`kth_largest`, `top_p_cut`).

// A float's bits as an unsigned key in the float's order (-0 just below +0).
static inline uint32_t order_key(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Counts or masses into 4 interleaved copies of a histogram of `size` buckets, summed at the end: neighbouring tokens
// mostly fall in one bucket, and one copy would make each add wait for the last.
template <typename T, typename Bucket, typename Value>
static std::vector<T> histogram(int64_t n, int size, Bucket&& bucket, Value&& value) {
  std::vector<T> h(4 * size, T(0));
  for (int64_t i = 0; i < n; ++i) h[(i & 3) * size + bucket(i)] += value(i);
  for (int b = 0; b < size; ++b) h[b] += h[size + b] + h[2 * size + b] + h[3 * size + b];
  h.resize(size);
  return h;
}

constexpr int64_t SUM_BLOCK = 64;

// The k-th largest of z (1 <= k <= n, no NaN). Where k is at most the number of blocks of SUM_BLOCK tokens, the k-th
// largest of the blocks' maxima is a floor with at least k tokens at or above it, and only those are searched (k = 50
// of SmolLM2's 49152 logits: ~100 of them). Else the bucket of the leading 12 bits holding it, then that bucket alone.
static float kth_largest(const float* z, int64_t n, int64_t k, std::vector<float>& found) {
  const int64_t blocks = (n + SUM_BLOCK - 1) / SUM_BLOCK;
  if (k <= blocks) {
    found.assign(blocks, -INFINITY);
    for (int64_t b = 0; b < blocks; ++b) {
      float m = -INFINITY;
      const int64_t end = std::min(n, (b + 1) * SUM_BLOCK);
#pragma omp simd reduction(max : m)
      for (int64_t i = b * SUM_BLOCK; i < end; ++i) m = z[i] > m ? z[i] : m;
      found[b] = m;
    }
    std::nth_element(found.begin(), found.begin() + (k - 1), found.end(), std::greater<float>());
    const float floor = found[k - 1];
    found.clear();
    for (int64_t i = 0; i < n; ++i)
      if (z[i] >= floor) found.push_back(z[i]);
    std::nth_element(found.begin(), found.begin() + (k - 1), found.end(), std::greater<float>());
    return found[k - 1];
  }
  const auto count = histogram<int64_t>(n, 4096, [&](int64_t i) { return order_key(z[i]) >> 20; },
                                        [](int64_t) { return int64_t{1}; });
  int64_t above = 0;
  int b = 4095;
  for (; b > 0 && above + count[b] < k; --b) above += count[b];
  found.clear();
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int>(order_key(z[i]) >> 20) == b) found.push_back(z[i]);
  const int64_t at = k - above - 1;
  std::nth_element(found.begin(), found.begin() + at, found.end(), std::greater<float>());
  return found[at];
}

// e[i] = exp(z[i] - top) where z[i] >= floor, else 0.
static void weights_of(const float* z, int64_t n, float top, float floor, float* e) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 t = _mm512_set1_ps(top), f = _mm512_set1_ps(floor);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(z + i);
    const __mmask16 keep = _mm512_cmp_ps_mask(v, f, _CMP_GE_OQ);
    _mm512_storeu_ps(e + i, _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(v, t))));
  }
#elif defined(SHARDMESH_AVX2)
  const __m256 t = _mm256_set1_ps(top), f = _mm256_set1_ps(floor);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(z + i);
    _mm256_storeu_ps(e + i, _mm256_and_ps(_mm256_cmp_ps(v, f, _CMP_GE_OQ), exp8(_mm256_sub_ps(v, t))));
  }
#endif
  for (; i < n; ++i) e[i] = z[i] >= floor ? std::exp(z[i] - top) : 0.f;
}

// The weights' sums in float64 by blocks of SUM_BLOCK tokens, and their total (the blocks' sums in order).
static double block_sums(const float* e, int64_t n, std::vector<double>& sums) {
  sums.assign((n + SUM_BLOCK - 1) / SUM_BLOCK, 0.0);
  double total = 0.0;
  for (size_t b = 0; b < sums.size(); ++b) {
    const int64_t end = std::min<int64_t>(n, (static_cast<int64_t>(b) + 1) * SUM_BLOCK);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = static_cast<int64_t>(b) * SUM_BLOCK; i < end; ++i) s += e[i];
    sums[b] = s;
    total += s;
  }
  return total;
}

// The weights' masses at or above 2^0, 2^-3, ..., 2^-21 (float32 sums, for a floor only: see top_p_cut).
constexpr int FLOORS = 8;
static constexpr float floor_at(int j) { return 1.f / static_cast<float>(1 << (3 * j)); }
static std::vector<float> masses_above(const float* e, int64_t n) {
  std::vector<float> mass(FLOORS, 0.f);
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 acc[FLOORS], floors[FLOORS];
  for (int j = 0; j < FLOORS; ++j) { acc[j] = _mm512_setzero_ps(); floors[j] = _mm512_set1_ps(floor_at(j)); }
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    for (int j = 0; j < FLOORS; ++j)
      acc[j] = _mm512_mask_add_ps(acc[j], _mm512_cmp_ps_mask(v, floors[j], _CMP_GE_OQ), acc[j], v);
  }
  for (int j = 0; j < FLOORS; ++j) mass[j] = _mm512_reduce_add_ps(acc[j]);
#elif defined(SHARDMESH_AVX2)
  __m256 acc[FLOORS], floors[FLOORS];
  for (int j = 0; j < FLOORS; ++j) { acc[j] = _mm256_setzero_ps(); floors[j] = _mm256_set1_ps(floor_at(j)); }
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(e + i);
    for (int j = 0; j < FLOORS; ++j)
      acc[j] = _mm256_add_ps(acc[j], _mm256_and_ps(_mm256_cmp_ps(v, floors[j], _CMP_GE_OQ), v));
  }
  for (int j = 0; j < FLOORS; ++j) mass[j] = hsum8(acc[j]);
#endif
  for (; i < n; ++i)
    for (int j = 0; j < FLOORS; ++j) mass[j] += e[i] >= floor_at(j) ? e[i] : 0.f;
  return mass;
}

// Top-p's cut on the weights e (zero where dropped already): every token whose weight ranked above it (by z, then
// id) reaches top_p of the whole is zeroed. The cut falls among the tokens at or above any floor whose mass reaches
// the target: the largest such floor of `masses_above` (its float32 sum asked to pass the target by 0.1%, more than
// its rounding) leaves few tokens to sort (SmolLM2-sized random logits at temperature 0.7, top-p 0.9: 54 kept of ~100).
// Where none does, or the walk runs out first, every kept token is bucketed by the leading 12 bits of its weight
// (sign, exponent, 3 bits of mantissa: in the order of z, weights being at most 1); the buckets' masses from the top
// find the one the cut falls in, and only its tokens are sorted.
static void top_p_cut(const float* z, float* e, int64_t n, double top_p, std::vector<double>& sums,
                      std::vector<int64_t>& found) {
  const double target = top_p * block_sums(e, n, sums);
  // `found` in order of z (then id), after a weight of `above` ranked higher: its tokens kept while the weight ranked
  // above them is below the target, the rest zeroed; false, and nothing zeroed, where they all fall below it.
  auto cut_among = [&](double above) {
    std::sort(found.begin(), found.end(), [&](int64_t a, int64_t b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
    size_t kept = 0;
    for (; kept < found.size() && above < target; ++kept) above += e[found[kept]];
    if (above < target) return false;
    for (size_t q = kept; q < found.size(); ++q) e[found[q]] = 0.f;
    return true;
  };
  const auto masses = masses_above(e, n);
  for (int j = 0; j < FLOORS; ++j) {
    if (masses[j] < target * 1.001) continue;
    const float floor = floor_at(j);
    found.clear();
    for (int64_t i = 0; i < n; ++i)
      if (e[i] >= floor) found.push_back(i);
    if (!cut_among(0.0)) break;  // the float32 mass overstated it after all: the buckets' way
    for (int64_t i = 0; i < n; ++i) e[i] = e[i] < floor ? 0.f : e[i];
    return;
  }
  auto bucket = [&](int64_t i) { uint32_t b; std::memcpy(&b, e + i, 4); return std::min<uint32_t>(b >> 20, 1023); };
  const auto mass = histogram<double>(n, 1024, bucket, [&](int64_t i) { return static_cast<double>(e[i]); });
  double above = 0.0;
  int cut = 1023;
  for (; cut >= 0 && above + mass[cut] < target; --cut) above += mass[cut];
  if (cut < 0) return;  // the sums' rounding left the whole short of the target: every token stays
  found.clear();
  for (int64_t i = 0; i < n; ++i) {
    const int k = static_cast<int>(bucket(i));
    if (k < cut) e[i] = 0.f;
    else if (k == cut && e[i] > 0.f) found.push_back(i);
  }
  cut_among(above);  // short of the target only by the sums' rounding: then the whole bucket stays
}

// A row's settings, as `sampling.draw_table` lays them out (float64): temperature (0: greedy), top_k (0: none),
// top_p (1: none), min_p (0: none).
struct DrawSettings {
  float temperature;
  int64_t top_k;
  double top_p;
  float min_p;
  explicit DrawSettings(const double* row)
      : temperature(static_cast<float>(row[0])), top_k(static_cast<int64_t>(row[1])), top_p(row[2]),
        min_p(static_cast<float>(row[3])) {}
};

// One thread's buffers for its rows' draws.
struct DrawScratch {
  std::vector<float> z, e, fbucket;
  std::vector<int64_t> ibucket;
  std::vector<double> sums;
};

// One row's draw (see above), or -1 where its logits hold a NaN or no finite value.
static int64_t draw_row(const float* x, int64_t n, const DrawSettings& d, double u, DrawScratch& w) {
  auto& z = w.z;
  auto& e = w.e;
  z.resize(n);
  e.resize(n);
  const float temperature = d.temperature;
  float top = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] / temperature;
    z[i] = v;
    nan |= v != v;
    top = v > top ? v : top;
  }
  if (nan || !std::isfinite(top)) return -1;
  const float floor = d.top_k > 0 && d.top_k < n ? kth_largest(z.data(), n, d.top_k, w.fbucket) : -INFINITY;
  weights_of(z.data(), n, top, floor, e.data());
  if (d.top_p < 1.0) top_p_cut(z.data(), e.data(), n, d.top_p, w.sums, w.ibucket);
  if (d.min_p > 0.f)
    for (int64_t i = 0; i < n; ++i) e[i] = e[i] < d.min_p ? 0.f : e[i];
  // The running sum in id order, a block at a time until the block the draw falls in, then a token at a time.
  const auto& sums = w.sums;
  const double target = u * block_sums(e.data(), n, w.sums);
  double run = 0.0;
  for (size_t b = 0; b < sums.size(); ++b) {
    if (sums[b] <= 0.0) continue;
    if (run + sums[b] <= target && b + 1 < sums.size()) {
      run += sums[b];
      continue;
    }
    const int64_t begin = static_cast<int64_t>(b) * SUM_BLOCK, end = std::min<int64_t>(n, begin + SUM_BLOCK);
    for (int64_t i = begin; i < end; ++i) {
      if (e[i] <= 0.f) continue;
      run += e[i];
      if (run > target) return i;
    }
  }
  for (int64_t i = n - 1; i >= 0; --i)  // past the end only by rounding: the last kept token
    if (e[i] > 0.f) return i;
  return -1;  // unreached: the largest weight, 1, is always kept
}

// The draws of the rows of x (rows, n) whose temperature is above 0 (`table`: (rows, 4) settings, `u`: each row's
// uniform), into out; the greedy rows' entries are left as they are. Parallel over the sampled rows.
static void draw_rows(const float* x, int64_t rows, int64_t n, const double* table, const double* u, int64_t* out) {
  std::vector<int64_t> sampled;
  for (int64_t r = 0; r < rows; ++r) if (table[4 * r] > 0.0) sampled.push_back(r);
  at::parallel_for(0, static_cast<int64_t>(sampled.size()), 1, [&](int64_t j0, int64_t j1) {
    DrawScratch scratch;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t r = sampled[j];
      out[r] = draw_row(x + r * n, n, DrawSettings(table + 4 * r), u[r], scratch);
    }
  });
}

// sampling.uniform: the top 53 bits of draw_seed(seed, position), SplitMix64's finaliser of the pair (the seed's
// bits as Python's unsigned 64-bit arithmetic has them).
static double uniform_of(int64_t seed, int64_t position) {
  uint64_t z = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(position) + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

static void check_draw_table(const torch::Tensor& table, int64_t rows, const char* who) {
  TORCH_CHECK(table.dim() == 2 && table.size(0) == rows && table.size(1) == 4 && table.scalar_type() == at::kDouble &&
                  table.is_contiguous(),
              who, ": the sampling table must be a contiguous (", rows, ", 4) float64 tensor, not ", table.sizes(), " ",
              table.scalar_type());
}

// Each row's draw of `sampling.draw`: x (rows, n) float32 logits, `table` each row's settings ((rows, 4) float64, as
// `sampling.draw_table` gives them, every temperature above 0) and `u` each row's uniform in [0, 1) (float64). -1 for
// a row whose logits hold a NaN or no finite value.
torch::Tensor sample_rows(torch::Tensor x, torch::Tensor table, torch::Tensor u) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "sample_rows: x must be (rows, n > 0) float32, not ", x.sizes(), " ", x.scalar_type());
  const int64_t rows = x.size(0);
  check_draw_table(table, rows, "sample_rows");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble && u.is_contiguous(),
              "sample_rows: u must be (", rows, ",) float64, not ", u.sizes(), " ", u.scalar_type());
  const double* t = table.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(t[4 * r] > 0.0, "sample_rows: row ", r, "'s temperature must be above 0, not ", t[4 * r]);
  auto xc = x.contiguous();
  auto ids = torch::empty({rows}, torch::kLong);
  draw_rows(xc.data_ptr<float>(), rows, x.size(1), t, u.data_ptr<double>(), ids.data_ptr<int64_t>());
  return ids;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, Opt bias, Opt scale) {
  TORCH_CHECK(x.dim() == 2, "linear: x must be (rows, in)");
  auto xf = as_float(x);
  const int64_t M = xf.size(0), K = xf.size(1);
  auto y = torch::empty({M, w.size(0)}, xf.options());
  torch::Tensor b, s;
  gemm(xf.data_ptr<float>(), M, K, w, groups_ptr(scale), opt_ptr(bias, b), y.data_ptr<float>(),
       x.scalar_type() == at::kBFloat16);
  return y.to(x.scalar_type());
}

// Row-major float32 weights (N, K) as a checkpoint stores them (rows may be a column slice of longer ones: stride
// ld), for the products the offload streamer maps from the file (no blocked copy): y = x w^T + b, RB weight rows per
// pass. Each row's dot product runs along K in turn (four sums), and the pass's RB sums are then added across lanes
// together, RB outputs in one register (`lane_sums`). Rows one after another keep a pass one stream through memory:
// the first version interleaved eight rows (two sums each), eight streams at once, and reached 32 GB/s on one Zen 5
// core where this reaches 38-39 GB/s and the blocked layout 37-38 (SmolLM2's products, one row, weights in memory).
constexpr int RB = 16;
#ifdef __AVX512F__
// The first min(left, 16) lanes: a row's tail.
static inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}
// Lane i of the result: the sum of a[i]'s 16 lanes. Pairs of registers are interleaved and added three times
// (within 128-bit lanes, then across them), 8 + 4 + 2 + 1 additions where one reduction per register takes four.
static inline __m512 lane_sums(const __m512* a) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 (0+2), a1 (0+2), a0 (1+3), a1 (1+3)] for a0, a1 = a[2i], a[2i+1]
    s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of a[4i .. 4i + 3]
    const __m512d p = _mm512_castps_pd(s8[2 * i]), q = _mm512_castps_pd(s8[2 * i + 1]);
    s4[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0 + 1 and 2 + 3 of a[8i .. 8i + 3], then of a[8i + 4 .. 8i + 7]
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], 0x88), _mm512_shuffle_f32x4(s2[0], s2[1], 0xdd));
}
#endif
// out[i] = x . w[i] for the first `rows` (<= RB) rows of w (row stride ld).
static inline void rows_dot(const float* x, int64_t K, const float* w, int64_t ld, int rows, float* out) {
#ifdef __AVX512F__
  constexpr int A = 4;  // sums per row: four FMAs in flight hide their latency
  __m512 r[RB];
  for (int i = 0; i < RB; ++i) {
    r[i] = _mm512_setzero_ps();
    if (i >= rows) continue;
    const float* wi = w + i * ld;
    __m512 a[A];
    for (int j = 0; j < A; ++j) a[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 * A <= K; k += 16 * A)
      for (int j = 0; j < A; ++j)
        a[j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * j), _mm512_loadu_ps(wi + k + 16 * j), a[j]);
    for (; k < K; k += 16) {
      const __mmask16 mk = lanes(K - k);
      a[0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, x + k), _mm512_maskz_loadu_ps(mk, wi + k), a[0]);
    }
    r[i] = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  }
  _mm512_mask_storeu_ps(out, lanes(rows), lane_sums(r));
#else
  for (int i = 0; i < rows; ++i) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t k = 0; k < K; ++k) a += x[k] * w[i * ld + k];
    out[i] = a;
  }
#endif
}

// y[m * ldy + j] = x[m] . w[j] + bias[j] for the N rows of w (row stride ld).
static void rows_gemm(const float* x, int64_t M, int64_t K, const float* w, int64_t ld, int64_t N, const float* bias,
                      float* y, int64_t ldy) {
  at::parallel_for(0, (N + RB - 1) / RB, 4, [&](int64_t r0, int64_t r1) {
    float out[RB];
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n0 = r * RB;
      const int nn = static_cast<int>(std::min<int64_t>(RB, N - n0));
      for (int64_t m = 0; m < M; ++m) {  // the pass's rows stay in cache from one input row to the next
        rows_dot(x + m * K, K, w + n0 * ld, ld, nn, out);
        for (int i = 0; i < nn; ++i) y[m * ldy + n0 + i] = out[i] + (bias ? bias[n0 + i] : 0.f);
      }
    }
  });
}

static void check_rows(const torch::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kFloat && w.stride(1) == 1,
              "row-major weights must be float32 (N, ", K, ") with contiguous rows, not ", w.scalar_type(), " ",
              w.sizes());
}

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, Opt bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rows_linear: x must be float32 (rows, in)");
  check_rows(w, x.size(1));
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xc.options());
  torch::Tensor keep;
  rows_gemm(xc.data_ptr<float>(), M, K, w.data_ptr<float>(), w.stride(0), N, opt_ptr(bias, keep),
            y.data_ptr<float>(), N);
  return y;
}

// Row-major int8 weights with their groups' scales, as an int8 shard's streamed layers map them from its int8 copy
// (`int8_copy`): `int8_gemm` (`int8_cpu.ROW_SOURCE`), the loop `int8_cpu.linear` runs in eager steps, so both sum
// alike.
@ROW@

// One product of a layer half: its weight `pack`ed (one tensor; `rows` false), or, for a layer the offload streamer
// maps (`rows` true), the row-major blocks of a stacked product in output order (q, k, v; gate, up), each as the
// file holds it: float32 blocks of the checkpoint, or int8 blocks of the int8 copy, each followed by its scales.
using Weights = std::vector<torch::Tensor>;
static bool int8_pairs(const Weights& w) { return !w.empty() && w[0].scalar_type() == at::kChar; }
static int64_t out_features(const Weights& w) {
  const size_t step = int8_pairs(w) ? 2 : 1;  // (weight, scales) pairs: count the weights' rows
  int64_t n = 0;
  for (size_t i = 0; i < w.size(); i += step) n += w[i].size(0);
  return n;
}
static void product(const float* x, int64_t M, int64_t K, const Weights& w, bool rows, const at::Half* scale,
                    const float* bias, float* y, bool round_bf16) {
  if (!rows) {
    TORCH_CHECK(w.size() == 1, "a packed product is one tensor, not ", w.size());
    gemm(x, M, K, w[0], scale, bias, y, round_bf16);
    return;
  }
  TORCH_CHECK(!round_bf16 && scale == nullptr, "row-major (streamed) weights are for float32 activations");
  const int64_t N = out_features(w);
  int64_t col = 0;
  if (int8_pairs(w)) {
    TORCH_CHECK(w.size() % 2 == 0, "row-major int8 blocks come as (weight, scales) pairs, not ", w.size(), " tensors");
    for (size_t i = 0; i < w.size(); i += 2) {
      const auto &q = w[i], &so = w[i + 1];
      check_int8_rows(q, so, K, "a streamed int8 product");
      int8_gemm(x, M, K, q.data_ptr<int8_t>(), q.stride(0), so.data_ptr<at::Half>(), so.stride(0), q.size(0),
                bias ? bias + col : nullptr, y + col, N);
      col += q.size(0);
    }
    return;
  }
  for (const auto& b : w) {
    check_rows(b, K);
    rows_gemm(x, M, K, b.data_ptr<float>(), b.stride(0), b.size(0), bias ? bias + col : nullptr, y + col, N);
    col += b.size(0);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// A decoder layer's halves for the rows of a step (`cpu_decode`: decode rows, and short prompts whose rows each attend
// over the cache up to their own position), as `model.py` computes them.
// ---------------------------------------------------------------------------------------------------------------

// h = weight * rms_norm(x), rounded as the model rounds: the norm in float32, to the dtype, times the weight. The sum
// of squares in double (each square is exact there), so its order hardly matters.
template <typename T, typename U>
static void rms_norm_rows(const T* x, int64_t M, int64_t H, const U* w, double eps, bool bf16, float* h) {
  for (int64_t m = 0; m < M; ++m) {
    const T* xm = x + m * H;
    float* hm = h + m * H;
    double ss = 0;
    int64_t i = 0;
#ifdef SHARDMESH_LANES
    SumSq sq;
    for (; i + L <= H; i += L) sq.add(vload(xm + i));
    ss = sq.total();
#endif
    for (int64_t j = i; j < H; ++j) ss += static_cast<double>(load(xm, j)) * load(xm, j);
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / H) + static_cast<float>(eps));
    i = 0;
#ifdef SHARDMESH_LANES
    for (; i + L <= H; i += L)
      vput(hm + i, vround(bf16, vmul(vload(w + i), vround(bf16, vmul(vload(xm + i), vset(r))))));
#endif
    for (; i < H; ++i) hm[i] = round_to(bf16, load(w, i) * round_to(bf16, load(xm, i) * r));
  }
}
static void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, bool bf16, float* h) {
  const auto xc = x.contiguous(), wc = weight.contiguous();
  with_data(xc, [&](auto* xp) {
    with_data(wc, [&](auto* wp) { rms_norm_rows(xp, x.size(0), x.size(1), wp, eps, bf16, h); });
  });
}

// out (M, H) in x's dtype: x + y when `residual`, else y alone (a partial sum before the all-reduce), each rounded
// once to the dtype.
static torch::Tensor finish(const torch::Tensor& x, const float* y, bool residual) {
  const auto xc = x.contiguous();
  auto out = torch::empty_like(xc);
  with_data(xc, [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    if (residual) add_into(xp, y, out.data_ptr<T>(), xc.numel());
    else put_all(y, out.data_ptr<T>(), xc.numel());
  });
  return out;
}

// Positions per attention segment. A row attending over more than this takes its softmax a segment at a time, each
// segment's weighted values normalized by its own sum, and folds the segments in order (`merge_segment`). Why: a decode
// step of one sequence has one task per key-value head (SmolLM2: 3), and two threads split 3 tasks 2:1 (16 threads
// 3:0), while at 4096 positions attention is a third of a SmolLM2 step. Where the threads would not share a step's
// tasks evenly, each segment is a task of its own (`attend_runs`). Prompts take the same segments and the same merges,
// so a prompt's rows and the same tokens decoded one by one give the same numbers. On the Xeon of family 6 model 207
// (2 threads, in process, alternated step by step with no segments): one sequence's step at 2048 positions 0.96x the
// time in bfloat16 and 0.95x in float32, at 4096 0.93x both; a 2048-token prompt and 16 sequences' steps within noise.
// Segments of 256 and 512 measured the same within noise at 2048 and 4096 positions, and cost up to 2% just past
// 512. A multiple of 16 (of L); `set_attend_segment` (for tests) changes it.
constexpr int64_t ATTEND_SEGMENT = 1024;
static std::atomic<int64_t> attend_segment{ATTEND_SEGMENT};

// Sets the positions per attention segment and returns the last.
int64_t set_attend_segment(int64_t positions) {
  TORCH_CHECK(positions > 0 && positions % 16 == 0, "attention segments: a positive multiple of 16, not ", positions);
  return attend_segment.exchange(positions);
}

#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
// The attention over the lane layer (`Lanes`: 16 floats on AVX-512, 8 on AVX2), with what differs by ISA first: one
// multiply-add, a vector's sum, L vectors' sums at once, and a softmax over masked tails.
constexpr int64_t MAX_HD = 256;    // head dims up to 256 keep a key's or value's slices in registers
constexpr int64_t MAX_GROUP = 16;  // query heads per key-value head that `attend_group` takes at once
constexpr int64_t RUN_ROWS = 8;    // a prompt's consecutive rows that attend together (`attend_rows`: at most this)
constexpr int64_t AHEAD = 8;       // cached positions fetched ahead of the one being read
#endif

#ifdef __AVX512F__
static inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors: a transposing tree of 45 instructions where 16 reductions of
// one vector each took ~8 and a scalar store.
static inline __m512 vsums(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane, of a = v[2i] and b = v[2i + 1]: a0 + a2, b0 + b2, a1 + a3, b1 + b3
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane, each of v[4i .. 4i + 3]'s four lanes there summed, in order
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int even = _MM_SHUFFLE(2, 0, 2, 0), odd = _MM_SHUFFLE(3, 1, 3, 1);  // 128-bit lanes 0, 2 and 1, 3
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], even), _mm512_shuffle_f32x4(u[0], u[1], odd));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], even), _mm512_shuffle_f32x4(u[2], u[3], odd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, even), _mm512_shuffle_f32x4(w0, w1, odd));
}

// Each of `group` rows of n scores (score, one after another) becomes its probabilities: exp16 of each less the row's
// largest, over their sum. With `stats`, row h's largest and sum go to stats[2h] and stats[2h + 1] (a segment's, for
// `merge_segment`).
static inline void softmax_rows(float* score, int64_t group, int64_t n, float* stats = nullptr) {
  for (int64_t h = 0; h < group; ++h) {
    float* sh = score + h * n;
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(sh + j));
    float top = _mm512_reduce_max_ps(best);
    for (; j < n; ++j) top = std::max(top, sh[j]);
    __m512 sum = _mm512_setzero_ps();
    const __m512 topv = _mm512_set1_ps(top);
    for (j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(n - j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + j), topv));
      _mm512_mask_storeu_ps(sh + j, k, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
    }
    const float all = _mm512_reduce_add_ps(sum);
    if (stats != nullptr) {
      stats[2 * h] = top;
      stats[2 * h + 1] = all;
    }
    const __m512 total = _mm512_set1_ps(all);
    for (j = 0; j < n; j += 16) {
      const __mmask16 k = lanes(n - j);
      _mm512_mask_storeu_ps(sh + j, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, sh + j), total));
    }
  }
}
#elif defined(SHARDMESH_AVX2)
static inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(__m256 v) { return hsum8(v); }

// r[j] = the sum of v[j]'s 8 lanes, for 8 vectors: 6 horizontal adds, 2 lane swaps and an add.
static inline __m256 vsums(const __m256* v) {
  // per 128-bit half: v[0]'s four lanes summed, then v[1]'s, v[2]'s and v[3]'s (u0), v[4]'s to v[7]'s (u1)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// softmax_rows 8 lanes wide, exp8 for exp16.
static inline void softmax_rows(float* score, int64_t group, int64_t n, float* stats = nullptr) {
  for (int64_t h = 0; h < group; ++h) {
    float* sh = score + h * n;
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(sh + j));
    float top = hmax8(best);
    for (; j < n; ++j) top = std::max(top, sh[j]);
    __m256 sum = _mm256_setzero_ps();
    const __m256 topv = _mm256_set1_ps(top);
    for (j = 0; j < n; j += 8) {
      const __m256i k = lanes8(n - j);
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(sh + j, k), topv)), _mm256_castsi256_ps(k));
      _mm256_maskstore_ps(sh + j, k, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float all = hsum8(sum);
    if (stats != nullptr) {
      stats[2 * h] = top;
      stats[2 * h + 1] = all;
    }
    const __m256 total = _mm256_set1_ps(all);
    for (j = 0; j < n; j += 8) {
      const __m256i k = lanes8(n - j);
      _mm256_maskstore_ps(sh + j, k, _mm256_div_ps(_mm256_maskload_ps(sh + j, k), total));
    }
  }
}
#endif

#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
// The scores of the group's heads (q, one after another, head dim L * c) against one cached key, loaded as kv, at
// position j of n: one horizontal sum each.
static inline void scores_at(const float* q, int64_t group, const Lanes* kv, int64_t c, int64_t j, int64_t n,
                             float scale, float* score) {
  for (int64_t h = 0; h < group; ++h) {
    const float* qh = q + h * L * c;
    Lanes d = vmul(vload(qh), kv[0]);
    for (int64_t i = 1; i < c; ++i) d = vfma(vload(qh + L * i), kv[i], d);
    score[h * n + j] = vsum(d) * scale;
  }
}

// Positions [j, j + L) of a head's cache (keys or values) as float32, one after another: a float32 cache's own rows,
// a bfloat16 one's widened into tile once for all the group's heads, read by each from L1. The next L are fetched
// meanwhile.
template <int C, typename T>
static inline const float* block_at(const T* cache, int64_t j, float* tile) {
  constexpr int64_t hd = L * C, row = hd * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < L; ++r)
    for (int64_t b = 0; b < row; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + (j + L + r) * hd) + b, _MM_HINT_T0);
  if constexpr (std::is_same_v<T, float>) {
    (void)tile;
    return cache + j * hd;
  } else {
    for (int64_t r = 0; r < L; ++r)
      for (int i = 0; i < C; ++i) vput(tile + r * hd + L * i, vload(cache + (j + r) * hd + L * i));
    return tile;
  }
}

// One head's scores (q · key × scale) against a block of L positions (kb: L keys of L * C, one after another) into
// dst: each key's products summed in registers, the L sums reduced together (`vsums`).
template <int C>
static inline void block_scores(const float* qh, const float* kb, float scale, float* dst) {
  constexpr int64_t hd = L * C;
  Lanes d[L];
  const Lanes q0 = vload(qh);
  for (int r = 0; r < L; ++r) d[r] = vmul(q0, vload(kb + r * hd));
  for (int i = 1; i < C; ++i) {
    const Lanes qi = vload(qh + L * i);
    for (int r = 0; r < L; ++r) d[r] = vfma(qi, vload(kb + r * hd + L * i), d[r]);
  }
  vput(dst, vmul(vsums(d), vset(scale)));
}

// The `group` query heads of R rows (at most RUN_ROWS) of one slot (row r's at q + r * qs; a prompt's consecutive rows,
// or one decode row) against a key-value head's first n[r] cached positions (n ascending), head dim L * C, L positions
// at a time: each block of keys and values is read (and, from a bfloat16 cache, widened) once for all the rows and
// heads, a head's L scores summed in registers and reduced together (`vsums`), its values' weighted sums added block by
// block into acc (R x group x hd), the last few positions one at a time. Every row runs the same operations in the same
// order whatever R is, so a prompt's rows give the same numbers as the same tokens decoded one by one. With `stats`,
// row r's heads' largest scores and sums of exponentials (a segment's, for `merge_segment`) at stats + r * group * 2. A
// 16-row bfloat16 SmolLM2 step at ~600 positions took 0.94x the time of one key at a time on AVX-512 (35.3 against 37.4
// ms; the cache's reads bound it there, ~20 GB/s), 0.84x in the AVX2 build on the same host. A decode row's weighted
// sums were once kept in registers across blocks, in a kernel of their own: alternated step by step against it (Xeon
// family 6 model 207, SmolLM2, 1 and 16 rows at 80-2048 positions, both dtypes, both ISA builds), this took 0.99-1.01x
// the time.
template <int C, typename T>
static void attend_rows(const float* q, int64_t qs, int64_t R, const int64_t* n, int64_t group, const T* keys,
                        const T* vals, float scale, float* score, float* acc, bool bf16, float* out, int64_t os,
                        float* stats = nullptr) {
  constexpr int64_t hd = L * C;
  alignas(64) float tile[L * hd];
  float* sc[RUN_ROWS];  // row r's scores (group x n[r]); on the stack, as decode rows come here one by one
  for (int64_t r = 0, at = 0; r < R; at += group * n[r], ++r) sc[r] = score + at;
  const int64_t blocks = n[R - 1] / L * L;
  for (int64_t j = 0; j < blocks; j += L) {
    const float* kb = block_at<C>(keys, j, tile);
    for (int64_t r = 0; r < R; ++r) {
      if (j >= n[r] / L * L) continue;  // past row r's full blocks
      const float* qr = q + r * qs;
      for (int64_t h = 0; h < group; ++h) block_scores<C>(qr + h * hd, kb, scale, sc[r] + h * n[r] + j);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = n[r] / L * L; j < n[r]; ++j) {  // the row's last few, one at a time
      Lanes kv[C];
      for (int i = 0; i < C; ++i) kv[i] = vload(keys + j * hd + L * i);
      scores_at(q + r * qs, group, kv, C, j, n[r], scale, sc[r]);
    }
    softmax_rows(sc[r], group, n[r], stats == nullptr ? nullptr : stats + r * group * 2);
  }
  std::fill(acc, acc + R * group * hd, 0.f);
  for (int64_t j = 0; j < blocks; j += L) {
    const float* vb = block_at<C>(vals, j, tile);
    for (int64_t r = 0; r < R; ++r) {
      if (j >= n[r] / L * L) continue;
      for (int64_t h = 0; h < group; ++h) {
        float* ah = acc + (r * group + h) * hd;
        Lanes a[C];
        for (int i = 0; i < C; ++i) a[i] = vload(ah + L * i);
        for (int k = 0; k < L; ++k) {
          const Lanes p = vset(sc[r][h * n[r] + j + k]);
          for (int i = 0; i < C; ++i) a[i] = vfma(p, vload(vb + k * hd + L * i), a[i]);
        }
        for (int i = 0; i < C; ++i) vput(ah + L * i, a[i]);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* ar = acc + r * group * hd;
    for (int64_t j = n[r] / L * L; j < n[r]; ++j) {
      Lanes kv[C];
      for (int i = 0; i < C; ++i) kv[i] = vload(vals + j * hd + L * i);
      for (int64_t h = 0; h < group; ++h) {
        const Lanes p = vset(sc[r][h * n[r] + j]);
        for (int i = 0; i < C; ++i) vput(ar + h * hd + L * i, vfma(p, kv[i], vload(ar + h * hd + L * i)));
      }
    }
    std::memcpy(out + r * os, ar, sizeof(float) * group * hd);
    round_all(bf16, out + r * os, group * hd);
  }
}

// Folds one segment's weighted values (o: group x hd, each head's normalized by its segment's sum; part: each head's
// largest score and sum of exponentials) into the running ones (out, stats), weighting each side by its share of the
// whole sum. Out of line, so that every caller runs the same instructions: decode steps and prompts merge alike.
__attribute__((noinline)) static void merge_segment(int64_t group, int64_t hd, const float* o, const float* part,
                                                    float* out, float* stats) {
  for (int64_t h = 0; h < group; ++h) {
    const float top = std::max(stats[2 * h], part[2 * h]);
    const float a = stats[2 * h + 1] * std::exp(stats[2 * h] - top), b = part[2 * h + 1] * std::exp(part[2 * h] - top);
    const float wa = a / (a + b), wb = b / (a + b);
    float* oh = out + h * hd;
    const float* ph = o + h * hd;
    for (int64_t i = 0; i < hd; ++i) oh[i] = wa * oh[i] + wb * ph[i];
    stats[2 * h] = top;
    stats[2 * h + 1] = a + b;
  }
}

// One row's heads (attend_rows, R = 1) over n positions a segment of S at a time, merged in order (one call where
// n <= S).
template <int C, typename T>
static void attend_segments(const float* q, int64_t group, const T* keys, const T* vals, int64_t n, int64_t S,
                            float scale, float* score, bool bf16, float* out) {
  constexpr int64_t hd = L * C;
  alignas(64) float acc[MAX_GROUP * hd];
  const auto one = [&](int64_t j, int64_t positions, bool round, float* o, float* stats) {
    attend_rows<C>(q, 0, 1, &positions, group, keys + j * hd, vals + j * hd, scale, score, acc, round, o, 0, stats);
  };
  if (n <= S) return one(0, n, bf16, out, nullptr);
  float stats[2 * MAX_GROUP], part[2 * MAX_GROUP];
  alignas(64) float seg[MAX_GROUP * hd];
  one(0, S, false, out, stats);
  for (int64_t j = S; j < n; j += S) {
    one(j, std::min(S, n - j), false, seg, part);
    merge_segment(group, hd, seg, part, out, stats);
  }
  round_all(bf16, out, group * hd);
}

// The `group` query heads (q, one after another) that share one key-value head against its n cached keys and
// values, head dim a multiple of L: each key and value is loaded once for all of them (3x less cache traffic for
// SmolLM2's groups of 3), the scores into score (group x n), softmax, the weighted values summed into out
// (group x hd). Per head, the same operations in the same order as one head alone. Head dims of 2, 4 or 8 vectors
// (AVX-512: 32, 64, 128; AVX2: 16, 32, 64) take `attend_rows`; the sums of more would not fit in registers.
template <typename T>
static void attend_group(const float* q, int64_t group, const T* keys, const T* vals, int64_t n, int64_t hd,
                         float scale, float* score, bool bf16, float* out) {
  const int64_t c = hd / L, S = attend_segment.load(std::memory_order_relaxed);
  if (c == 2) return attend_segments<2>(q, group, keys, vals, n, S, scale, score, bf16, out);
  if (c == 4) return attend_segments<4>(q, group, keys, vals, n, S, scale, score, bf16, out);
  if (c == 8) return attend_segments<8>(q, group, keys, vals, n, S, scale, score, bf16, out);
  Lanes kv[MAX_HD / L];
  const int64_t row = hd * static_cast<int64_t>(sizeof(T));  // bytes per cached position
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t b = 0; b < row; b += 64)  // a short stream per task: fetch ahead what the prefetcher would not
      _mm_prefetch(reinterpret_cast<const char*>(keys + (j + AHEAD) * hd) + b, _MM_HINT_T0);
    for (int64_t i = 0; i < c; ++i) kv[i] = vload(keys + j * hd + L * i);
    scores_at(q, group, kv, c, j, n, scale, score);
  }
  softmax_rows(score, group, n);
  alignas(64) float acc[MAX_GROUP * MAX_HD];
  std::fill(acc, acc + group * hd, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t b = 0; b < row; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(vals + (j + AHEAD) * hd) + b, _MM_HINT_T0);
    for (int64_t i = 0; i < c; ++i) kv[i] = vload(vals + j * hd + L * i);
    for (int64_t h = 0; h < group; ++h) {
      const Lanes p = vset(score[h * n + j]);
      float* ah = acc + h * hd;
      for (int64_t i = 0; i < c; ++i) vput(ah + L * i, vfma(p, kv[i], vload(ah + L * i)));
    }
  }
  std::memcpy(out, acc, sizeof(float) * group * hd);
  round_all(bf16, out, group * hd);
}
#endif

// Where position `pos` of key-value head g of `slot` starts in a layer's cache (slots, nkv heads, max_len
// positions, head dim), counted in cached positions: `KVCache`'s layout.
static inline int64_t cache_row(int64_t slot, int64_t g, int64_t nkv, int64_t max_len, int64_t pos) {
  return (slot * nkv + g) * max_len + pos;
}

// `cache_row` for a paged cache (`PagedKVCache`: blocks, nkv heads, BS positions, head dim): where the tile of
// key-value head g holding position `pos` of a sequence (its block table `table`) starts, counted in cached
// positions; the position is at offset pos % BS of it.
static inline int64_t block_row(const int64_t* table, int64_t g, int64_t nkv, int64_t BS, int64_t pos) {
  return (table[pos / BS] * nkv + g) * BS;
}

// RoPE on heads [h0, h1) of one row of the new queries and keys (queries, then keys, numbered together):
// x * cos + rotate_half(x) * sin at the row's position (c, s: its cos and sin rows), each rounded as the model rounds.
static void rope_heads(float* row, int64_t h0, int64_t h1, int64_t hd, const float* c, const float* s, bool bf16) {
  const int64_t half = hd / 2;
  for (int64_t h = h0; h < h1; ++h) {
    float* v = row + h * hd;
    int64_t i = 0;
#ifdef SHARDMESH_LANES
    for (; i + L <= half; i += L) {
      const Lanes a = vload(v + i), b = vload(v + i + half);
      vput(v + i, vround(bf16, vsub(vmul(a, vload(c + i)), vmul(b, vload(s + i)))));
      vput(v + i + half, vround(bf16, vadd(vmul(b, vload(c + i + half)), vmul(a, vload(s + i + half)))));
    }
#endif
    for (; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = round_to(bf16, a * c[i] - b * s[i]);
      v[i + half] = round_to(bf16, b * c[i + half] + a * s[i + half]);
    }
  }
}

// Whether no two of the M rows share a slot: a step of decode rows only, where no row attends over a key another row
// of the step writes.
static bool one_row_per_slot(const int64_t* slots, int64_t M) {
  std::vector<int64_t> sorted(slots, slots + M);
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

constexpr int64_t TASK_COST = 16;  // a task's own work (its queries, softmax, output) in positions' worth
// f(t, state) for attention tasks 0 .. tasks - 1, each thread with a State of its own; cost(t) is a task's work, in
// positions attended over plus TASK_COST. A prompt's row attends over every position up to its own, so its tasks' work
// grows with the row: the task range split in halves gave one thread three times the other's work on a long prompt
// (and prompts went to eager's fused attention above 128 tokens). Here each thread's contiguous range of tasks holds
// an even share of the work, and a thread done with its range takes the others' next tasks, as `over_blocks` does, so
// that none waits at the end. The ranges stay contiguous: taking the tasks longest first from one counter balanced
// them as well, but sent neighbouring rows, which read the same keys, to different threads (16 prompts of 46 tokens
// took 1.02-1.03x the time of halves). Each task is computed whole by one thread, so the numbers are the same whoever
// takes it.
template <typename State, typename Cost, typename F>
static void balanced_tasks(int64_t tasks, Cost&& cost, F&& f) {
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  int64_t total = 0;
  for (int64_t task = 0; task < tasks; ++task) total += cost(task);
  std::vector<BlockRange> ranges(T);
  int64_t t = 0, done = 0;
  for (int64_t task = 0; task < tasks && t < T; ++task) {  // range t starts where t / T of the work is done
    while (t < T && done * T >= total * t) ranges[t++].next.store(task, std::memory_order_relaxed);
    done += cost(task);
  }
  for (; t < T; ++t) ranges[t].next.store(tasks, std::memory_order_relaxed);
  for (int64_t r = 0; r < T; ++r)
    ranges[r].end = r + 1 < T ? ranges[r + 1].next.load(std::memory_order_relaxed) : tasks;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    State state;
    for (int64_t me = t0; me < t1; ++me)
      for (int64_t k = 0; k < T; ++k) {  // its own range, then the others' in turn
        BlockRange& r = ranges[(me + k) % T];
        for (int64_t i; (i = r.next.fetch_add(1, std::memory_order_relaxed)) < r.end;) f(i, state);
      }
  });
}

#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
// Whether `tasks` of equal work, split among the threads as whole tasks, leave over an eighth of their time idle (3
// on 2 threads: 2 and 1): then rows over several segments make a task per segment, to be shared evenly.
static bool uneven(int64_t tasks) {
  const int64_t T = at::get_num_threads();
  return (tasks + T - 1) / T * T * 8 > tasks * 9;
}

// Each run's first row, then M: a run is up to RUN_ROWS consecutive rows at consecutive positions, each of which
// `same(m)` says reads the keys row m - 1 reads (a prompt's rows, attending together).
template <typename Same>
static std::vector<int64_t> run_starts(int64_t M, const int64_t* pos, Same&& same) {
  std::vector<int64_t> first;
  for (int64_t m = 0; m < M; ++m)
    if (first.empty() || m - first.back() == RUN_ROWS || pos[m] != pos[m - 1] + 1 || !same(m)) first.push_back(m);
  first.push_back(M);
  return first;
}

// A step's rows (their keys and values already in the cache) attending by runs: up to RUN_ROWS consecutive rows of one
// slot at consecutive positions (a prompt's) against each key-value head in one task (`attend_rows`), each block of
// keys and values read once for the run instead of once a row. Rows over more than a segment of positions take
// them in order within the task, or, where the threads would not share the tasks evenly, a task per segment. Head
// dims of 2, 4 or 8 vectors.
template <typename T>
static void attend_runs(const float* qkv, int64_t M, int64_t nh, int64_t nkv, int64_t hd, const T* kc, const T* vc,
                        int64_t max_len, const int64_t* slots, const int64_t* pos, float scale, bool bf16,
                        float* out) {
  const int64_t width = (nh + 2 * nkv) * hd, group = nh / nkv, gh = group * hd;
  const int64_t S = attend_segment.load(std::memory_order_relaxed);
  const std::vector<int64_t> first = run_starts(M, pos, [&](int64_t m) { return slots[m] == slots[m - 1]; });
  const int64_t runs = static_cast<int64_t>(first.size()) - 1;
  std::vector<int64_t> n(M);
  for (int64_t m = 0; m < M; ++m) n[m] = pos[m] + 1;
  const auto segments = [&](int64_t m) { return (n[m] + S - 1) / S; };  // a run's last row has the most
  struct RunScratch {
    std::vector<float> score, acc, seg, part;
  };
  // Segment s of the run's rows that reach it against key-value head g, each row's weighted values (not rounded) at
  // o + (row - run's first) * os, its heads' largest scores and sums at st + (row - run's first) * group * 2.
  const auto segment = [&](int64_t run, int64_t g, int64_t s, float* o, int64_t os, float* st, RunScratch& scratch) {
    const int64_t m0 = first[run], m1 = first[run + 1];
    int64_t r0 = m0;
    while (n[r0] <= s * S) ++r0;
    const int64_t R = m1 - r0;
    int64_t local[RUN_ROWS], scores = 0;
    for (int64_t r = 0; r < R; ++r) scores += group * (local[r] = std::min(n[r0 + r], (s + 1) * S) - s * S);
    scratch.score.resize(scores);
    scratch.acc.resize(R * gh);
    const int64_t at = cache_row(slots[m0], g, nkv, max_len, s * S) * hd;
    const float* q = qkv + r0 * width + g * gh;
    auto rows = [&](auto c) {
      attend_rows<decltype(c)::value>(q, width, R, local, group, kc + at, vc + at, scale, scratch.score.data(),
                                      scratch.acc.data(), false, o + (r0 - m0) * os, os, st + (r0 - m0) * group * 2);
    };
    const int64_t c = hd / L;
    if (c == 2) rows(std::integral_constant<int, 2>{});
    else if (c == 4) rows(std::integral_constant<int, 4>{});
    else rows(std::integral_constant<int, 8>{});
  };
  const auto row_out = [&](int64_t m, int64_t g) { return out + (m * nh + g * group) * hd; };
  int64_t most = 1;
  for (int64_t m = 0; m < M; ++m) most = std::max(most, segments(m));
  if (most > 1 && uneven(runs * nkv)) {
    // Runs over several segments that the threads would not share evenly (a decode step of one sequence at a long
    // context): a task per segment, its rows' results in parts of their own, merged in order afterwards.
    std::vector<int64_t> task_at{0};  // (run, g)'s first task
    for (int64_t t = 0; t < runs * nkv; ++t) task_at.push_back(task_at.back() + segments(first[t / nkv + 1] - 1));
    const int64_t tasks = task_at.back();
    std::vector<int64_t> owner(tasks);  // each task's (run, g)
    for (int64_t t = 0; t < runs * nkv; ++t) std::fill(owner.begin() + task_at[t], owner.begin() + task_at[t + 1], t);
    std::vector<float> parts(tasks * RUN_ROWS * gh), part_stats(tasks * RUN_ROWS * group * 2);
    const auto cost = [&](int64_t t) {
      const int64_t rg = owner[t], s = t - task_at[rg];
      int64_t work = 0;
      for (int64_t m = first[rg / nkv]; m < first[rg / nkv + 1]; ++m)
        if (n[m] > s * S) work += std::min(n[m], (s + 1) * S) - s * S + TASK_COST;
      return work;
    };
    balanced_tasks<RunScratch>(tasks, cost, [&](int64_t t, RunScratch& scratch) {
      const int64_t rg = owner[t];
      segment(rg / nkv, rg % nkv, t - task_at[rg], parts.data() + t * RUN_ROWS * gh, gh,
              part_stats.data() + t * RUN_ROWS * group * 2, scratch);
    });
    for (int64_t rg = 0; rg < runs * nkv; ++rg) {
      const int64_t m0 = first[rg / nkv], g = rg % nkv, t0 = task_at[rg];
      for (int64_t m = m0; m < first[rg / nkv + 1]; ++m) {
        const int64_t r = m - m0;
        float* o = row_out(m, g);
        float st[2 * MAX_GROUP];
        std::memcpy(o, parts.data() + (t0 * RUN_ROWS + r) * gh, sizeof(float) * gh);
        std::memcpy(st, part_stats.data() + (t0 * RUN_ROWS + r) * group * 2, sizeof(float) * group * 2);
        for (int64_t s = 1; s < segments(m); ++s)
          merge_segment(group, hd, parts.data() + ((t0 + s) * RUN_ROWS + r) * gh,
                        part_stats.data() + ((t0 + s) * RUN_ROWS + r) * group * 2, o, st);
        round_all(bf16, o, gh);
      }
    }
    return;
  }
  const auto cost = [&](int64_t t) {
    int64_t work = 0;
    for (int64_t m = first[t / nkv]; m < first[t / nkv + 1]; ++m) work += n[m] + TASK_COST;
    return work;
  };
  balanced_tasks<RunScratch>(runs * nkv, cost, [&](int64_t t, RunScratch& scratch) {
    const int64_t run = t / nkv, g = t % nkv, m0 = first[run], m1 = first[run + 1];
    float st[RUN_ROWS * 2 * MAX_GROUP];
    segment(run, g, 0, row_out(m0, g), nh * hd, st, scratch);
    for (int64_t s = 1; s < segments(m1 - 1); ++s) {  // each later segment into scratch, then merged in order
      scratch.seg.resize((m1 - m0) * gh);
      scratch.part.resize((m1 - m0) * group * 2);
      segment(run, g, s, scratch.seg.data(), gh, scratch.part.data(), scratch);
      for (int64_t m = m0; m < m1; ++m)
        if (n[m] > s * S)
          merge_segment(group, hd, scratch.seg.data() + (m - m0) * gh, scratch.part.data() + (m - m0) * group * 2,
                        row_out(m, g), st + (m - m0) * group * 2);
    }
    for (int64_t m = m0; m < m1; ++m) round_all(bf16, row_out(m, g), gh);
  });
}
#endif

#ifdef SHARDMESH_LANES
// The line of `next` (the next block's tile, nullptr for none) at the offset of the one being read from this tile,
// into L1: a tile's lines asked for one by one as the tile before is read. Why: asked for all at once at a block's
// start (64 prefetches in a row for a float32 tile of 16 positions), the next tiles came no sooner than with no
// prefetch at all, and a 16-row SmolLM2 step on blocks of 16 read its tiles at half the slot cache's rate; asked for
// so, the step took 0.70x the time (float32 and bfloat16, 300 tokens of context; one row 0.93x).
template <typename T>
static inline void ask_beside(const T* next, int64_t at) {
  if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + at), _MM_HINT_T0);
}

// The first `left` (< L) of v's lanes to p: a masked store, the others untouched.
static inline void vput_first(float* p, Lanes v, int64_t left) {
#ifdef __AVX512F__
  _mm512_mask_storeu_ps(p, lanes(left), v);
#else
  _mm256_maskstore_ps(p, lanes8(left), v);
#endif
}

// Scores of GC query heads (q: rows hd apart, float32) against positions [0, count) of a block's (hd, BS) key tile:
// s[h * ss + i] = scale * q_h . key i. A vector of L positions at a time, summed over the dimensions, each key row
// loaded once for the GC heads, two sums per head in flight (even and odd dimensions: hd is whole vectors, so even).
// `next`: the next block's key tile, asked for line by line (`ask_beside`).
template <int GC, typename T>
static inline void tile_scores(const float* q, int64_t hd, const T* kb, int64_t BS, int64_t count, float scale,
                               float* s, int64_t ss, const T* next) {
  int64_t i = 0;
  // A vector of positions at a time; the block's last few too, as a vector that stays within the tile's rows (its
  // lanes past `count`, positions not written yet or another sequence's, are computed and not stored). Why: nearly
  // every prompt row's last block is partial, and its dot products one position at a time made the attention of 16
  // prompts of 46 tokens 2.8x the slot cache's (perf samples, SmolLM2 float32) and the whole step 1.09x.
  for (; i < count && (i + L <= count || i + L <= BS); i += L) {
    Lanes a0[GC], a1[GC];
    for (int h = 0; h < GC; ++h) a0[h] = a1[h] = vset(0.f);
    for (int64_t x = 0; x < hd; x += 2) {
      ask_beside(next, x * BS + i);
      ask_beside(next, (x + 1) * BS + i);
      const Lanes k0 = vload(kb + x * BS + i), k1 = vload(kb + (x + 1) * BS + i);
      for (int h = 0; h < GC; ++h) {
        a0[h] = vfma(vset(q[h * hd + x]), k0, a0[h]);
        a1[h] = vfma(vset(q[h * hd + x + 1]), k1, a1[h]);
      }
    }
    for (int h = 0; h < GC; ++h) {
      const Lanes v = vmul(vadd(a0[h], a1[h]), vset(scale));
      if (i + L <= count) vput(s + h * ss + i, v);
      else vput_first(s + h * ss + i, v, count - i);
    }
  }
  for (; i < count; ++i)  // a block size that is not whole vectors
    for (int h = 0; h < GC; ++h) {
      float a = 0.f;
      for (int64_t x = 0; x < hd; ++x) a += q[h * hd + x] * load(kb, x * BS + i);
      s[h * ss + i] = a * scale;
    }
}

// acc[h * hd + x] += sum_i p[h * ps + i] * value i [x] over positions [0, count) of a block's (BS, hd) value tile, for
// GC heads: a vector of dimensions at a time, its sums in registers, each value row loaded once for the GC heads, even
// and odd positions apart. `next`: the next block's value tile, asked for line by line (`ask_beside`).
template <int GC, typename T>
static inline void tile_values(const float* p, int64_t ps, const T* vb, int64_t hd, int64_t count, float* acc,
                               const T* next) {
  for (int64_t x = 0; x < hd; x += L) {
    Lanes a0[GC], a1[GC];
    for (int h = 0; h < GC; ++h) {
      a0[h] = vload(acc + h * hd + x);
      a1[h] = vset(0.f);
    }
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      ask_beside(next, i * hd + x);
      ask_beside(next, (i + 1) * hd + x);
      const Lanes v0 = vload(vb + i * hd + x), v1 = vload(vb + (i + 1) * hd + x);
      for (int h = 0; h < GC; ++h) {
        a0[h] = vfma(vset(p[h * ps + i]), v0, a0[h]);
        a1[h] = vfma(vset(p[h * ps + i + 1]), v1, a1[h]);
      }
    }
    if (i < count) {
      const Lanes v0 = vload(vb + i * hd + x);
      for (int h = 0; h < GC; ++h) a0[h] = vfma(vset(p[h * ps + i]), v0, a0[h]);
    }
    for (int h = 0; h < GC; ++h) vput(acc + h * hd + x, vadd(a0[h], a1[h]));
  }
}

// f(h0, GC) for the heads of a group, up to four at a time (GC a compile-time count: the sums stay in registers).
template <typename F>
static inline void by_fours(int64_t group, F&& f) {
  for (int64_t h0 = 0; h0 < group; h0 += 4) {
    switch (std::min<int64_t>(4, group - h0)) {
      case 4: f(h0, std::integral_constant<int, 4>{}); break;
      case 3: f(h0, std::integral_constant<int, 3>{}); break;
      case 2: f(h0, std::integral_constant<int, 2>{}); break;
      default: f(h0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// `attend` over a paged cache (`PagedKVCache`): row m is a token at position pos[m] of its sequence, whose positions p
// lie at offset p % BS of block tables[m * maxb + p / BS]. Per block and key-value head, keys are a (hd, BS) tile,
// transposed, and values a (BS, hd) tile, the layout `paged_attention` reads in eager mode: a block's scores are
// vectors along its positions, with no sums across lanes. Rows attend by runs, as the slot cache's prompts do
// (`attend_runs`): up to RUN_ROWS consecutive rows of one sequence at consecutive positions (a prompt's) read each
// block's tiles once for the run, from memory for its first row that reaches the block and from L1 for the others,
// each tile's successor asked for line by line while it is read. A row's heads run the same operations in the same
// order whatever its run, so a prompt's rows give the same numbers as the same tokens decoded one by one. (Each row
// reading its blocks alone measured within noise of this on a noisy Ice Lake Xeon; the slot cache's prompts share
// their keys so, and its long prompts gained from it.) In a decode step (rows of distinct sequences, runs of one) the
// task first takes its row's RoPE and writes its key and value, as the slot cache's decode rows do; such rows write
// positions no other row reads (the layout checks that no two rows write one block's position, and blocks shared by a
// common prefix are full). A prompt's rows are all written first.
template <typename T>
static void attend_paged(float* qkv, int64_t M, int64_t nh, int64_t nkv, int64_t hd, T* kc, T* vc, int64_t BS,
                         const int64_t* tables, int64_t maxb, const int64_t* pos, const float* cos, const float* sin,
                         bool bf16, float* out) {
  const int64_t width = (nh + 2 * nkv) * hd, group = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const auto put_kv = [&](int64_t m, int64_t g) {  // row m's key and value of head g into its block
    const float* row = qkv + m * width;
    const int64_t at = block_row(tables + m * maxb, g, nkv, BS, pos[m]) * hd, off = pos[m] % BS;
    const float *key = row + (nh + g) * hd, *value = row + (nh + nkv + g) * hd;
    for (int64_t x = 0; x < hd; ++x) {
      put(kc + at, x * BS + off, key[x]);
      put(vc + at, off * hd + x, value[x]);
    }
  };
  // Rows of distinct sequences (no two tables start at one block: a decode step's) write their own keys in their
  // tasks; rows that may be one sequence's (a prompt's, attending over each other's new keys) are all written first.
  std::vector<int64_t> starts(M);
  for (int64_t m = 0; m < M; ++m) starts[m] = tables[m * maxb];
  const bool in_tasks = one_row_per_slot(starts.data(), M);
  if (!in_tasks)
    for (int64_t m = 0; m < M; ++m) {
      rope_heads(qkv + m * width, 0, nh + nkv, hd, cos + pos[m] * hd, sin + pos[m] * hd, bf16);
      for (int64_t g = 0; g < nkv; ++g) put_kv(m, g);
    }
  // Runs: a row joins the row before's when its table names the same blocks as the row before's for every block that
  // row reads (the run reads its last row's table).
  const std::vector<int64_t> first = run_starts(M, pos, [&](int64_t m) {
    const int64_t* before = tables + (m - 1) * maxb;
    return std::equal(before, before + pos[m - 1] / BS + 1, tables + m * maxb);
  });
  const int64_t runs = static_cast<int64_t>(first.size()) - 1;
  // A task per run and key-value head; or, with runs enough to share the threads (16 decode rows of SmolLM2: 16 tasks
  // against 48), a task per run for all its heads, which reads a block's tiles of every head, side by side in the
  // cache, together.
  const int64_t span = runs >= 4 * at::get_num_threads() ? nkv : 1, per_run = nkv / span;
  struct Sums {
    std::vector<float> score, acc;
  };
  const auto cost = [&](int64_t t) {
    int64_t work = 0;
    for (int64_t m = first[t / per_run]; m < first[t / per_run + 1]; ++m) work += (pos[m] + 1) * span + TASK_COST;
    return work;
  };
  balanced_tasks<Sums>(runs * per_run, cost, [&](int64_t t, Sums& sums) {
    const int64_t m0 = first[t / per_run], R = first[t / per_run + 1] - m0, g0 = t % per_run * span, g1 = g0 + span;
    const int64_t* table = tables + (m0 + R - 1) * maxb;  // the run's last row's
    const int64_t last = pos[m0 + R - 1] + 1;             // positions its last row attends over
    if (in_tasks) {                                       // a decode row: R is 1
      float* row = qkv + m0 * width;
      const float *cm = cos + pos[m0] * hd, *sm = sin + pos[m0] * hd;
      rope_heads(row, g0 * group, g1 * group, hd, cm, sm, bf16);  // the groups' queries
      rope_heads(row, nh + g0, nh + g1, hd, cm, sm, bf16);        // their keys
      for (int64_t g = g0; g < g1; ++g) put_kv(m0, g);
    }
    const int64_t heads = span * group;  // each row's query heads of the task, adjacent in the row
    int64_t at[RUN_ROWS], total = 0;     // row r's scores (heads x its positions) at score + at[r]
    for (int64_t r = 0; r < R; ++r) {
      at[r] = total;
      total += heads * (pos[m0 + r] + 1);
    }
    std::vector<float>& score = sums.score;
    score.resize(total);
    const auto tile_of = [&](const T* cache, int64_t j, int64_t g) {
      return cache + block_row(table, g, nkv, BS, j * BS) * hd;
    };
    // f(tile, r, j, h, n, count, gc, next) for block j's tile of each of the task's heads, the run's rows that reach
    // the block (row r attending over n positions, `count` of them in this block) and up to four of their query heads
    // at a time (from h, the task's numbering; gc of them); `next`, the same head's tile of the next block, for the
    // block's first row and first four heads to ask for as they read (nullptr past the last block).
    const auto over_tiles = [&](const T* cache, auto&& f) {
      for (int64_t j = 0, r0 = 0; j * BS < last; ++j) {
        while (pos[m0 + r0] + 1 <= j * BS) ++r0;  // rows before r0 end before block j
        for (int64_t g = g0; g < g1; ++g) {
          const T* tile = tile_of(cache, j, g);
          const T* after = (j + 1) * BS < last ? tile_of(cache, j + 1, g) : nullptr;
          for (int64_t r = r0; r < R; ++r) {
            const int64_t n = pos[m0 + r] + 1;
            by_fours(group, [&](int64_t h0, auto gc) {
              f(tile, r, j, (g - g0) * group + h0, n, std::min(BS, n - j * BS), gc,
                r == r0 && h0 == 0 ? after : nullptr);
            });
          }
        }
      }
    };
    const auto query = [&](int64_t r, int64_t h) { return qkv + (m0 + r) * width + g0 * group * hd + h * hd; };
    over_tiles(kc, [&](const T* keys, int64_t r, int64_t j, int64_t h, int64_t n, int64_t count, auto gc,
                       const T* next) {
      tile_scores<decltype(gc)::value>(query(r, h), hd, keys, BS, count, scale, score.data() + at[r] + h * n + j * BS,
                                       n, next);
    });
    for (int64_t r = 0; r < R; ++r) softmax_rows(score.data() + at[r], heads, pos[m0 + r] + 1);
    std::vector<float>& acc = sums.acc;
    acc.assign(R * heads * hd, 0.f);
    over_tiles(vc, [&](const T* values, int64_t r, int64_t j, int64_t h, int64_t n, int64_t count, auto gc,
                       const T* next) {
      tile_values<decltype(gc)::value>(score.data() + at[r] + h * n + j * BS, n, values, hd, count,
                                       acc.data() + (r * heads + h) * hd, next);
    });
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + ((m0 + r) * nh + g0 * group) * hd;
      std::memcpy(o, acc.data() + r * heads * hd, sizeof(float) * heads * hd);
      round_all(bf16, o, heads * hd);
    }
  });
}
#endif

// RoPE on the new queries and keys, the keys and values into the cache, each row's heads against its slot; or, given
// block tables (`maxb` > 0: `slots` holds M rows of maxb), against its sequence's blocks (`attend_paged`).
template <typename T>
static void attend(float* qkv, int64_t M, int64_t nh, int64_t nkv, int64_t hd, T* kc, T* vc, int64_t max_len,
                   const int64_t* slots, const int64_t* pos, const float* cos, const float* sin, bool bf16,
                   float* out, int64_t maxb = 0) {
  if (maxb > 0) {
#ifdef SHARDMESH_LANES
    TORCH_CHECK(hd % L == 0 && hd <= MAX_HD && nh / nkv <= MAX_GROUP,
                "attention_block: a paged cache takes head dims of whole vectors up to ", MAX_HD, " and at most ",
                MAX_GROUP, " query heads per key-value head");
    attend_paged(qkv, M, nh, nkv, hd, kc, vc, max_len, slots, maxb, pos, cos, sin, bf16, out);
    return;
#else
    TORCH_CHECK(false, "attention_block: a paged cache needs the kernels built for AVX2 or AVX-512");
#endif
  }
  const int64_t width = (nh + 2 * nkv) * hd;
  // Row m's key and value of head g into the cache at its position.
  auto put_kv = [&](int64_t m, int64_t g) {
    const float* row = qkv + m * width;
    const int64_t at = cache_row(slots[m], g, nkv, max_len, pos[m]) * hd;
    put_all(row + (nh + g) * hd, kc + at, hd);
    put_all(row + (nh + nkv + g) * hd, vc + at, hd);
  };
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t group = nh / nkv;
#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
  const bool grouped = hd % L == 0 && hd <= MAX_HD && group <= MAX_GROUP;
  const int64_t vectors = hd / L;
  const bool by_runs = grouped && (vectors == 2 || vectors == 4 || vectors == 8);
  // Decode rows only: each task takes its own row's RoPE and cache writes for its key-value head, so they run on
  // both threads, and each thread attends with the queries and keys it has just written in its own cache.
  // Otherwise (a prompt's rows attend over each other's new keys) every row's keys are written first. So are those
  // of decode rows over more than a segment of positions whose tasks the threads would not share evenly: they attend
  // a task per segment (`attend_runs`).
  bool in_tasks = grouped && one_row_per_slot(slots, M);
  if (in_tasks && by_runs && uneven(M * nkv)) {
    const int64_t S = attend_segment.load(std::memory_order_relaxed);
    in_tasks = std::all_of(pos, pos + M, [&](int64_t p) { return p + 1 <= S; });
  }
#else
  const bool in_tasks = false;
#endif
  if (!in_tasks)
    for (int64_t m = 0; m < M; ++m) {
      rope_heads(qkv + m * width, 0, nh + nkv, hd, cos + pos[m] * hd, sin + pos[m] * hd, bf16);
      for (int64_t g = 0; g < nkv; ++g) put_kv(m, g);
    }
#if defined(__AVX512F__) || defined(SHARDMESH_AVX2)
  if (grouped) {  // a task per row and key-value head
    auto task = [&](int64_t t, std::vector<float>& score) {
      const int64_t m = t / nkv, g = t % nkv, n = pos[m] + 1;
      if (in_tasks) {
        float* row = qkv + m * width;
        const float *c = cos + pos[m] * hd, *s = sin + pos[m] * hd;
        rope_heads(row, g * group, (g + 1) * group, hd, c, s, bf16);  // the group's queries
        rope_heads(row, nh + g, nh + g + 1, hd, c, s, bf16);         // its key
        put_kv(m, g);
      }
      score.resize(group * n);
      const int64_t at = cache_row(slots[m], g, nkv, max_len, 0) * hd;
      attend_group(qkv + m * width + g * group * hd, group, kc + at, vc + at, n, hd, scale, score.data(), bf16,
                   out + (m * nh + g * group) * hd);
    };
    if (in_tasks) {  // decode rows: as many positions each, so even halves
      at::parallel_for(0, M * nkv, 1, [&](int64_t t0, int64_t t1) {
        std::vector<float> score;
        for (int64_t t = t0; t < t1; ++t) task(t, score);
      });
      return;
    }
    if (by_runs) {
      attend_runs(qkv, M, nh, nkv, hd, kc, vc, max_len, slots, pos, scale, bf16, out);
      return;
    }
    balanced_tasks<std::vector<float>>(
        M * nkv, [&](int64_t t) { return pos[t / nkv] + 1 + TASK_COST; }, task);
    return;
  }
#endif
  struct HeadScratch {
    std::vector<float> score, acc;
  };
  const auto head_cost = [&](int64_t t) { return pos[t / nh] + 1 + TASK_COST; };
  balanced_tasks<HeadScratch>(M * nh, head_cost, [&](int64_t t, HeadScratch& sums) {  // a task per row, query head
    const int64_t m = t / nh, h = t % nh, g = h / group, n = pos[m] + 1;
    const float* q = qkv + m * width + h * hd;
    const int64_t at = cache_row(slots[m], g, nkv, max_len, 0) * hd;
    const T* keys = kc + at;
    const T* vals = vc + at;
    std::vector<float>& score = sums.score;
    std::vector<float>& acc = sums.acc;
    score.resize(n);
    acc.assign(hd, 0.f);
    float best = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      float d = 0;
#pragma omp simd reduction(+ : d)
      for (int64_t i = 0; i < hd; ++i) d += q[i] * load(keys, j * hd + i);
      score[j] = d * scale;
      best = std::max(best, score[j]);
    }
    float total = 0;
    for (int64_t j = 0; j < n; ++j) total += (score[j] = std::exp(score[j] - best));
    for (int64_t j = 0; j < n; ++j) {
      const float p = score[j] / total;
#pragma omp simd
      for (int64_t i = 0; i < hd; ++i) acc[i] += p * load(vals, j * hd + i);
    }
    float* o = out + (m * nh + h) * hd;
    for (int64_t i = 0; i < hd; ++i) o[i] = round_to(bf16, acc[i]);
  });
}

// The cache rows this step's keys and values go to, asked for with intent to write before the qkv product, which
// leaves time to bring them: written after it, each row's lines came from memory while the calling thread waited
// (the rows of other slots, and other layers' caches, are long gone from the caches by then). A 16-row bfloat16
// SmolLM2 step with a 1024-position cache took 0.98x the time (20.3-21.3 against 21.3-21.6 ms, the two builds
// alternated 4 rounds); with a 256-position cache, within noise.
static void ask_to_write(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t M, int64_t n_kv,
                         const int64_t* slots, const int64_t* pos) {
  const int64_t max_len = k_cache.size(2), row = k_cache.size(3) * k_cache.element_size();
  const char* kc = static_cast<const char*>(k_cache.data_ptr());
  const char* vc = static_cast<const char*>(v_cache.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t at = cache_row(slots[m], g, n_kv, max_len, pos[m]) * row;
      for (int64_t b = 0; b < row; b += 64) {
        __builtin_prefetch(kc + at + b, 1, 3);
        __builtin_prefetch(vc + at + b, 1, 3);
      }
    }
}

// `ask_to_write` over a paged cache (`attend_paged`): each row's key goes down a column of its block's (hd, BS) key
// tile, a line per dimension, and its value to a row of the value tile.
static void ask_to_write_paged(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t M, int64_t n_kv,
                               const int64_t* tables, int64_t maxb, const int64_t* pos) {
  const int64_t hd = v_cache.size(3), BS = v_cache.size(2), size = v_cache.element_size();
  const char* kc = static_cast<const char*>(k_cache.data_ptr());
  const char* vc = static_cast<const char*>(v_cache.data_ptr());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < n_kv; ++g) {
      const int64_t at = block_row(tables + m * maxb, g, n_kv, BS, pos[m]) * hd, off = pos[m] % BS;
      for (int64_t x = 0; x < hd; ++x) __builtin_prefetch(kc + (at + x * BS + off) * size, 1, 3);
      for (int64_t b = 0; b < hd * size; b += 64) __builtin_prefetch(vc + (at + off * hd) * size + b, 1, 3);
    }
}

// Each product comes as its packed weight, its bias and (int8 weights) its scales.
torch::Tensor attention_block(torch::Tensor x, torch::Tensor norm, double eps, Weights w_qkv, Opt b_qkv, Opt s_qkv,
                              Weights w_o, Opt b_o, Opt s_o, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor slots, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                              int64_t n_heads, int64_t n_kv, bool residual, bool rows) {
  // `slots` (M) for the slot cache, (slots, n_kv, max_len, hd) per layer; or block tables (M, blocks) for a paged
  // cache, whose keys are (blocks, n_kv, hd, block size) and values (blocks, n_kv, block size, hd).
  const bool paged = slots.dim() == 2;
  const int64_t M = x.size(0), H = x.size(1), hd = v_cache.size(3), max_len = v_cache.size(2);
  const int64_t n_qkv = out_features(w_qkv);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(n_qkv == (n_heads + 2 * n_kv) * hd, "attention_block: qkv width does not match the heads");
  TORCH_CHECK(k_cache.scalar_type() == x.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "attention_block: the cache must be contiguous, in the activations' dtype");
  TORCH_CHECK(!paged || (slots.size(0) == M && slots.size(1) > 0 && k_cache.size(2) == hd &&
                         k_cache.size(3) == max_len && k_cache.size(0) == v_cache.size(0)),
              "attention_block: block tables of ", slots.sizes(), " for ", M, " rows, paged keys of ",
              k_cache.sizes(), " and values of ", v_cache.sizes());
  const Scratch h = scratch(M * H), qkv = scratch(M * n_qkv), att = scratch(M * n_heads * hd), y = scratch(M * H);
  auto sl = slots.to(torch::kLong).contiguous(), ps = positions.to(torch::kLong).contiguous();
  if (paged) ask_to_write_paged(k_cache, v_cache, M, n_kv, sl.data_ptr<int64_t>(), sl.size(1), ps.data_ptr<int64_t>());
  else ask_to_write(k_cache, v_cache, M, n_kv, sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>());
  rms_norm(x, norm, eps, bf16, h.get());
  torch::Tensor keep_b, keep_o;
  product(h.get(), M, H, w_qkv, rows, groups_ptr(s_qkv), opt_ptr(b_qkv, keep_b), qkv.get(), bf16);
  auto c = as_float(cos), s = as_float(sin);
  auto run = [&](auto* kc, auto* vc) {
    attend(qkv.get(), M, n_heads, n_kv, hd, kc, vc, max_len, sl.data_ptr<int64_t>(), ps.data_ptr<int64_t>(),
           c.data_ptr<float>(), s.data_ptr<float>(), bf16, att.get(), paged ? sl.size(1) : 0);
  };
  if (bf16)
    run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else
    run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  product(att.get(), M, n_heads * hd, w_o, rows, groups_ptr(s_o), opt_ptr(b_o, keep_o), y.get(), bf16);
  return finish(x, y.get(), residual);
}

// The last stage's head for decode rows: float32 logits (M, N) of the final norm of x, rounded as the eager head's are
// (its bfloat16 output, then .float()): one call where the eager head took six ops. With caches cold, as between
// forwards, SmolLM2's head took 3.72 against 4.16 ms at one row, 3.77 against 4.77 at 16 (docs/performance.md).
torch::Tensor head_block(torch::Tensor x, torch::Tensor norm, double eps, Weights w, Opt b, Opt s) {
  const int64_t M = x.size(0), H = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Scratch h = scratch(M * H);
  rms_norm(x, norm, eps, bf16, h.get());
  auto y = torch::empty({M, out_features(w)}, torch::kFloat);
  torch::Tensor keep;
  product(h.get(), M, H, w, false, groups_ptr(s), opt_ptr(b, keep), y.data_ptr<float>(), bf16);
  return y;
}

#ifdef __AVX512F__
static inline __m512 vexp(__m512 v) { return exp16(v); }
#elif defined(SHARDMESH_AVX2)
static inline __m256 vexp(__m256 v) { return exp8(v); }
#endif

// a = silu(gate) * up over columns [c0, c1) of one row of `inter` (gu: gate, then up), each rounded as the eager model
// rounds.
static void swiglu(const float* gu, int64_t inter, int64_t c0, int64_t c1, bool bf16, float* a) {
  const float* up = gu + inter;
  int64_t i = c0;
#ifdef SHARDMESH_LANES
  for (; i + L <= c1; i += L) {
    const Lanes g = vload(gu + i), silu = vdiv(g, vadd(vset(1.f), vexp(vsub(vset(0.f), g))));
    vput(a + i, vround(bf16, vmul(vround(bf16, silu), vload(up + i))));
  }
#endif
  for (; i < c1; ++i) a[i] = round_to(bf16, round_to(bf16, gu[i] / (1.0f + std::exp(-gu[i]))) * up[i]);
}

// SwiGLU's columns a chunk at a time, all rows of each: split between the threads at every row count (by rows, a
// 16-row step's ran on one thread while the other waited), inline when there is too little (one row).
constexpr int64_t SWIGLU_CHUNK = 64;   // columns per task, a multiple of the lanes
constexpr int64_t SWIGLU_TASK = 4096;  // elements per task at least (one row of SmolLM2's 1536 columns stays inline)

torch::Tensor mlp_block(torch::Tensor x, torch::Tensor norm, double eps, Weights w_gate_up, Opt b_gate_up,
                        Opt s_gate_up, Weights w_down, Opt b_down, Opt s_down, bool residual, bool rows) {
  const int64_t M = x.size(0), H = x.size(1), n_gate_up = out_features(w_gate_up), inter = n_gate_up / 2;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const Scratch h = scratch(M * H), gu = scratch(M * n_gate_up), act = scratch(M * inter), y = scratch(M * H);
  rms_norm(x, norm, eps, bf16, h.get());
  torch::Tensor keep_gu, keep_d;
  product(h.get(), M, H, w_gate_up, rows, groups_ptr(s_gate_up), opt_ptr(b_gate_up, keep_gu), gu.get(), bf16);
  const int64_t chunks = (inter + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
  const int64_t grain = std::max<int64_t>(1, SWIGLU_TASK / (std::max<int64_t>(M, 1) * SWIGLU_CHUNK));
  at::parallel_for(0, chunks, grain, [&](int64_t k0, int64_t k1) {
    const int64_t c0 = k0 * SWIGLU_CHUNK, c1 = std::min(inter, k1 * SWIGLU_CHUNK);
    for (int64_t m = 0; m < M; ++m) swiglu(gu.get() + m * n_gate_up, inter, c0, c1, bf16, act.get() + m * inter);
  });
  product(act.get(), M, inter, w_down, rows, groups_ptr(s_down), opt_ptr(b_down, keep_d), y.get(), bf16);
  return finish(x, y.get(), residual);
}

// Every decoder layer of a shard whose layers are whole (no tensor-parallel all-reduce between the halves, no
// streamed weights) in one call: layer i's attention_block, then its mlp_block, each adding its residual, the calls
// CpuDecode makes one at a time otherwise. Why: each call from Python converts ~20 arguments and re-enters the
// interpreter between parallel regions, with the caches cold after a product has streamed its weights. The layers'
// arguments are converted once (`stack_layers`, argument j of a half as element i of its list), and kept here under a
// number until `drop_layers`; each step passes only what changes (`decode_layers`). On a Xeon of family 6 model 207,
// a SmolLM2 step in process took 0.97x the time in bfloat16 at one row, 0.98-0.99x at 16 rows and in float32
// (docs/performance.md).
struct LayerStack {
  std::vector<torch::Tensor> norm, k_cache, v_cache, post_norm;
  std::vector<double> eps, post_eps;
  std::vector<Weights> w_qkv, w_o, w_gate_up, w_down;
  std::vector<Opt> b_qkv, s_qkv, b_o, s_o, b_gate_up, s_gate_up, b_down, s_down;
  int64_t n_heads, n_kv;
};
static double since_epoch(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
static std::mutex stacks_lock;
static std::map<int64_t, std::shared_ptr<const LayerStack>> stacks;
static int64_t stacks_made = 0;

int64_t stack_layers(std::vector<torch::Tensor> norm, std::vector<double> eps, std::vector<Weights> w_qkv,
                     std::vector<Opt> b_qkv, std::vector<Opt> s_qkv, std::vector<Weights> w_o, std::vector<Opt> b_o,
                     std::vector<Opt> s_o, std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache,
                     int64_t n_heads, int64_t n_kv, std::vector<torch::Tensor> post_norm,
                     std::vector<double> post_eps, std::vector<Weights> w_gate_up, std::vector<Opt> b_gate_up,
                     std::vector<Opt> s_gate_up, std::vector<Weights> w_down, std::vector<Opt> b_down,
                     std::vector<Opt> s_down) {
  const size_t n = norm.size();
  for (const size_t size : {eps.size(), w_qkv.size(), b_qkv.size(), s_qkv.size(), w_o.size(), b_o.size(), s_o.size(),
                            k_cache.size(), v_cache.size(), post_norm.size(), post_eps.size(), w_gate_up.size(),
                            b_gate_up.size(), s_gate_up.size(), w_down.size(), b_down.size(), s_down.size()})
    TORCH_CHECK(size == n, "stack_layers: every list holds one entry per layer (", n, "), one holds ", size);
  auto stack = std::make_shared<const LayerStack>(LayerStack{
      std::move(norm), std::move(k_cache), std::move(v_cache), std::move(post_norm), std::move(eps),
      std::move(post_eps), std::move(w_qkv), std::move(w_o), std::move(w_gate_up), std::move(w_down),
      std::move(b_qkv), std::move(s_qkv), std::move(b_o), std::move(s_o), std::move(b_gate_up), std::move(s_gate_up),
      std::move(b_down), std::move(s_down), n_heads, n_kv});
  std::lock_guard<std::mutex> hold(stacks_lock);
  stacks[++stacks_made] = std::move(stack);
  return stacks_made;
}

// Forget stack `id` (its tensors are released): a no-op for one already dropped.
void drop_layers(int64_t id) {
  std::lock_guard<std::mutex> hold(stacks_lock);
  stacks.erase(id);
}

// Stack `id`, held for the caller's call (a drop meanwhile frees it only after).
std::shared_ptr<const LayerStack> held_stack(int64_t id, const char* who) {
  std::lock_guard<std::mutex> hold(stacks_lock);
  const auto it = stacks.find(id);
  TORCH_CHECK(it != stacks.end(), who, ": no stack of layers numbered ", id, " (dropped, or never made)");
  return it->second;
}

// Stack s's layers over x: layer i's attention_block, then its mlp_block, each half's output handed to `after`, which
// leaves the next input in x and returns 0, or a nonzero status that stops the layers and is returned. `residual`:
// the halves add their residuals (whole layers), else each returns its partial sum (a tensor-parallel rank's).
template <typename After>
static int64_t run_stack(const LayerStack& s, torch::Tensor& x, const torch::Tensor& slots,
                         const torch::Tensor& positions, const torch::Tensor& cos, const torch::Tensor& sin,
                         bool residual, After&& after) {
  for (size_t i = 0; i < s.norm.size(); ++i) {
    auto y = attention_block(x, s.norm[i], s.eps[i], s.w_qkv[i], s.b_qkv[i], s.s_qkv[i], s.w_o[i], s.b_o[i],
                             s.s_o[i], s.k_cache[i], s.v_cache[i], slots, positions, cos, sin, s.n_heads, s.n_kv,
                             residual, false);
    if (const int64_t status = after(y)) return status;
    y = mlp_block(x, s.post_norm[i], s.post_eps[i], s.w_gate_up[i], s.b_gate_up[i], s.s_gate_up[i], s.w_down[i],
                  s.b_down[i], s.s_down[i], residual, false);
    if (const int64_t status = after(y)) return status;
  }
  return 0;
}

torch::Tensor decode_layers(int64_t id, torch::Tensor x, torch::Tensor slots, torch::Tensor positions,
                            torch::Tensor cos, torch::Tensor sin) {
  const auto held = held_stack(id, "decode_layers");
  run_stack(*held, x, slots, positions, cos, sin, true, [&](torch::Tensor& y) {
    x = y;
    return int64_t{0};
  });
  return x;
}

// The embedding's rows of `n` token ids into dst, as nn.Embedding gives them; `who` names the caller in an error.
static void embed_rows(const torch::Tensor& table, const int64_t* id_of, int64_t n, void* dst, const char* who) {
  const int64_t vocab = table.size(0), row = table.size(1) * table.element_size();
  const auto* src = static_cast<const uint8_t*>(table.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(0 <= id_of[i] && id_of[i] < vocab, who, ": token id ", id_of[i], " is out of the embedding's ", vocab,
                " rows");
    std::memcpy(static_cast<uint8_t*>(dst) + i * row, src + id_of[i] * row, row);
  }
}

// How a call of several steps draws its rows: each greedy (`table` absent), or by `table`'s settings
// (`sampling.draw_table`: greedy where a temperature is 0) with each row's `seeds` (int64, the seed's bits).
struct StepDraws {
  const Opt& table;
  const Opt& seeds;
  StepDraws(const Opt& t, const Opt& s, int64_t rows, const char* who) : table(t), seeds(s) {
    TORCH_CHECK(t.has_value() == s.has_value(), who, ": a sampling table and seeds come together");
    if (!t) return;
    check_draw_table(*t, rows, who);
    TORCH_CHECK(s->dim() == 1 && s->size(0) == rows && s->scalar_type() == at::kLong && s->is_contiguous(), who,
                ": seeds must be (", rows, ",) int64, not ", s->sizes(), " ", s->scalar_type());
  }
};

// The alternatives a call's rows ask for (`top_logprobs`): `counts` (rows,) int64, how many each (0: none). Each step
// keeps each such row's that many largest logits of the model's (before any penalty) and their token ids, largest
// first, a tie going to the lower id and NaN above every number: `sampling.top_tokens`' order, so that a call of steps
// gives what a step at a time gives. Why: a call whose rows asked for alternatives went back to Python for every
// step's draw (docs/performance.md, "Alternatives inside a call of steps").
struct StepTops {
  std::vector<int64_t> count;
  int64_t most = 0;
  torch::Tensor ids, values;  // (steps, rows, most): row r's first count[r] of step k; the rest -1 and 0
  StepTops(const Opt& counts, int64_t steps, int64_t rows, int64_t vocab, const char* who) : count(rows, 0) {
    if (counts) {
      TORCH_CHECK(counts->dim() == 1 && counts->size(0) == rows && counts->scalar_type() == at::kLong, who,
                  ": top-logprob counts must be (", rows, ",) int64, not ", counts->sizes(), " ",
                  counts->scalar_type());
      const auto c = counts->contiguous();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = c.data_ptr<int64_t>()[r];
        TORCH_CHECK(n >= 0, who, ": row ", r, " asks for ", n, " top logprobs");
        count[r] = std::min(n, vocab);
        most = std::max(most, count[r]);
      }
    }
    ids = torch::empty({steps, rows, most}, torch::kLong);
    values = torch::empty({steps, rows, most}, torch::kFloat);
    std::fill_n(ids.data_ptr<int64_t>(), ids.numel(), int64_t{-1});
    std::fill_n(values.data_ptr<float>(), values.numel(), 0.f);
  }
  // a before b: NaN above every number, then the larger, then (equal) the lower id
  static bool above(float a, int64_t i, float b, int64_t j) {
    if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && (!std::isnan(b) || i < j);
    return a > b || (a == b && i < j);
  }
  // step k's, of its (rows, n) logits l
  void take(int64_t k, const float* l, int64_t rows, int64_t n) {
    if (most == 0) return;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t want = count[r];
      if (want == 0) continue;
      int64_t* id = ids.data_ptr<int64_t>() + (k * rows + r) * most;
      float* v = values.data_ptr<float>() + (k * rows + r) * most;
      const float* x = l + r * n;
      int64_t held = 0;
      for (int64_t i = 0; i < n;) {
        if (held == want) {
          const float last = v[want - 1];
          if (std::isnan(last)) break;  // a NaN held last: nothing after it comes before it
          if (i + TOP_LANES <= n && none_above(x + i, last)) {  // most of a row: skipped a vector at a time
            i += TOP_LANES;
            continue;
          }
        }
        for (const int64_t end = std::min(n, i + TOP_LANES); i < end; ++i) {
          const float xi = x[i];
          // ids come in increasing order, so a logit equal to the last held one comes after it
          if (held == want && !above(xi, i, v[held - 1], id[held - 1])) continue;
          int64_t at = held == want ? want - 1 : held++;
          for (; at > 0 && above(xi, i, v[at - 1], id[at - 1]); --at) {
            v[at] = v[at - 1];
            id[at] = id[at - 1];
          }
          v[at] = xi;
          id[at] = i;
        }
      }
    }
  }
  // Whether none of x[0 .. TOP_LANES) is above `last` (a number) or NaN: then none enters a full list.
#ifdef __AVX512F__
  static constexpr int64_t TOP_LANES = 16;
  static bool none_above(const float* x, float last) {
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(last), _CMP_NLE_UQ) == 0;
  }
#elif defined(SHARDMESH_AVX2)
  static constexpr int64_t TOP_LANES = 8;
  static bool none_above(const float* x, float last) {
    return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(last), _CMP_NLE_UQ)) == 0;
  }
#else
  static constexpr int64_t TOP_LANES = 1;
  static bool none_above(const float* x, float last) { return !(x[0] > last) && !std::isnan(x[0]); }
#endif
};

// Each row's k largest values of x (rows, n) float32 and their indices, in StepTops' order: (values, ids), (rows, k)
// each. What `sampling.top_tokens` takes on a CPU with the kernels loaded: its torch version took 4.2 ms for 16 rows
// of SmolLM2's 49152 logits (torch.topk alone 1.3), at the first step of every call asking for alternatives.
std::tuple<torch::Tensor, torch::Tensor> top_rows(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "top_rows: x must be (rows, n) float32, not ", x.sizes(),
              " ", x.scalar_type());
  TORCH_CHECK(1 <= k && k <= x.size(1), "top_rows: k must be in [1, ", x.size(1), "], not ", k);
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto counts = torch::empty({rows}, torch::kLong);
  std::fill_n(counts.data_ptr<int64_t>(), rows, k);
  StepTops tops(counts, 1, rows, n, "top_rows");
  tops.take(0, xc.data_ptr<float>(), rows, n);
  return {tops.values[0], tops.ids[0]};
}

// The penalties (engine.penalties) of a call's rows, kept across its steps: each penalised row's tokens so far (what
// the repetition penalty takes, once each), and how often each occurs in its completion (what frequency and presence
// count). `settings` is (rows, 4) float64, each row's
// repetition, frequency and presence penalties and its prompt's length (`sampling.penalty_table`); `tallies` (m, 4)
// int64, a line per (row, token) that occurs before the call's first draw: row, token, count, count in the completion
// (`TokenHistory.tallies`). A step applies them to its rows' logits in place (`apply`), as `penalise_` computes them,
// its draws are made, the logits put back (`restore`: a token's log-probability is the model's), and the drawn tokens
// counted for the next step (`add`). Why: a call of several steps with a penalty went back to Python for every step's
// draw, and took 1.08x the time a token of one without a penalty, at one row and at 16 (docs/performance.md,
// "Penalties inside a call of steps").
struct StepPenalties {
  struct Row {
    int64_t row;
    float repetition, frequency, presence;
    int64_t prompt_len;
    std::vector<int64_t> tokens;
    std::vector<float> generated;  // float32, as penalise_'s counts
    std::unordered_map<int64_t, size_t> at;
  };
  std::vector<Row> rows;
  bool any_repetition = false, any_frequency = false;  // as penalise_ applies each formula to every penalised row
  std::vector<std::pair<int64_t, float>> saved;       // (index into the logits, its value before the penalties)

  StepPenalties(const torch::Tensor& settings, const torch::Tensor& tallies, int64_t n_rows, const char* who) {
    TORCH_CHECK(settings.dim() == 2 && settings.size(0) == n_rows && settings.size(1) == 4 &&
                    settings.scalar_type() == at::kDouble && settings.is_contiguous(),
                who, ": the penalties must be a contiguous (", n_rows, ", 4) float64 tensor, not ", settings.sizes(),
                " ", settings.scalar_type());
    TORCH_CHECK(tallies.dim() == 2 && tallies.size(1) == 4 && tallies.scalar_type() == at::kLong &&
                    tallies.is_contiguous(),
                who, ": the tallies must be a contiguous (m, 4) int64 tensor, not ", tallies.sizes(), " ",
                tallies.scalar_type());
    const double* s = settings.data_ptr<double>();
    std::vector<int64_t> index(n_rows, -1);
    for (int64_t r = 0; r < n_rows; ++r) {
      const double* q = s + 4 * r;
      if (q[0] == 1.0 && q[1] == 0.0 && q[2] == 0.0) continue;  // not penalised (shardmesh.core.step.penalized)
      index[r] = static_cast<int64_t>(rows.size());
      Row row{r, static_cast<float>(q[0]), static_cast<float>(q[1]), static_cast<float>(q[2]),
              static_cast<int64_t>(q[3]), {}, {}, {}};
      rows.push_back(std::move(row));
      any_repetition |= q[0] != 1.0;
      any_frequency |= q[1] != 0.0 || q[2] != 0.0;
    }
    const int64_t* t = tallies.data_ptr<int64_t>();
    for (int64_t i = 0; i < tallies.size(0); ++i) {
      const int64_t* line = t + 4 * i;
      TORCH_CHECK(0 <= line[0] && line[0] < n_rows && index[line[0]] >= 0 && line[2] >= line[3] && line[3] >= 0,
                  who, ": tally ", i, " (row ", line[0], ", token ", line[1], ") is not of a penalised row's tokens");
      Row& row = rows[index[line[0]]];
      TORCH_CHECK(row.at.emplace(line[1], row.tokens.size()).second, who, ": tally ", i, " repeats token ", line[1],
                  " of row ", line[0]);
      row.tokens.push_back(line[1]);
      row.generated.push_back(static_cast<float>(line[3]));
    }
  }

  // Each penalised row of logits l (rows, n), in place, the values it changes saved; then each penalised greedy row's
  // token (`table`'s temperature 0) is its penalised row's argmax, into ids.
  void apply(float* l, int64_t n, const double* table, int64_t* ids);

  void restore(float* l) {
    for (const auto& [i, v] : saved) l[i] = v;
    saved.clear();
  }

  // Each row's drawn token, at one past its input's position pos[r], counted for the next step's draw.
  void add(const int64_t* ids, const int64_t* pos) {
    for (auto& row : rows) {
      const int64_t token = ids[row.row];
      const float in_completion = pos[row.row] + 1 >= row.prompt_len ? 1.f : 0.f;
      const auto [it, fresh] = row.at.emplace(token, row.tokens.size());
      if (fresh) {
        row.tokens.push_back(token);
        row.generated.push_back(in_completion);
      } else {
        row.generated[it->second] += in_completion;
      }
    }
  }
};

// penalise_'s arithmetic, each operation rounded as torch rounds it: contraction off, so that v - f * g is a product
// then a difference, not an FMA.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void StepPenalties::apply(float* l, int64_t n, const double* table, int64_t* ids) {
  for (const auto& row : rows) {
    float* x = l + row.row * n;
    for (size_t j = 0; j < row.tokens.size(); ++j) {
      const int64_t t = row.tokens[j];
      if (t < 0 || t >= n) continue;  // past the vocabulary: never sent by a gateway, left out as occurrences leaves it
      const bool generated = row.generated[j] > 0.f;
      if (!(any_repetition || (any_frequency && generated))) continue;
      float v = x[t];
      saved.emplace_back(row.row * n + t, v);
      if (any_repetition) v = v < 0.f ? v * row.repetition : v / row.repetition;
      if (any_frequency && generated) {
        const float by_count = row.frequency * row.generated[j];
        const float present = row.presence * 1.f;
        v = v - by_count;
        v = v - present;
      }
      x[t] = v;
    }
    if (table[4 * row.row] == 0.0) ids[row.row] = argmax_row(x, n);
  }
}
#pragma GCC pop_options

// A step on stack st after its input x: the layers at slots and positions, the head (head_block's norm, weights, bias,
// int8 scales) and each row's draw: greedy_rows' (ids, the argmax's logit, the row's log-sum-exp), the sampled rows'
// ids replaced by their draws (`draw_rows`, each uniform that of the drawn token's position, one past its input's),
// and each drawn token's logit (for its log-probability: (it - the argmax's) - the log-sum-exp).
static std::vector<torch::Tensor> layers_and_draw(const LayerStack& st, torch::Tensor x, const torch::Tensor& slots,
                                                  const torch::Tensor& positions, const torch::Tensor& cos,
                                                  const torch::Tensor& sin, const torch::Tensor& norm, double eps,
                                                  const Weights& w, const Opt& b, const Opt& s,
                                                  const StepDraws& how, StepPenalties* pen, StepTops& tops,
                                                  int64_t k) {
  run_stack(st, x, slots, positions, cos, sin, true, [&](torch::Tensor& y) {
    x = y;
    return int64_t{0};
  });
  const auto logits = head_block(x, norm, eps, w, b, s).contiguous();
  auto found = greedy_rows(logits);  // of the model's logits, before any penalty: what log-probabilities are of
  tops.take(k, logits.data_ptr<float>(), logits.size(0), logits.size(1));
  if (!how.table) {
    found.push_back(found[1]);
    return found;
  }
  const int64_t rows = logits.size(0), n = logits.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* seed = how.seeds->data_ptr<int64_t>();
  std::vector<double> u(rows);
  for (int64_t r = 0; r < rows; ++r) u[r] = uniform_of(seed[r], pos[r] + 1);
  int64_t* ids = found[0].data_ptr<int64_t>();
  float* l = logits.data_ptr<float>();
  const double* table = how.table->data_ptr<double>();
  if (pen) pen->apply(l, n, table, ids);
  draw_rows(l, rows, n, table, u.data(), ids);
  if (pen) pen->restore(l);
  auto picked = torch::empty({rows}, torch::kFloat);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ids[r] >= 0, "a sampled row's @NOT_FINITE@ (row ", r, ")");
    picked.data_ptr<float>()[r] = l[r * n + ids[r]];
  }
  if (pen) pen->add(ids, pos);
  found.push_back(picked);
  return found;
}

// A call's penalties, where it has any: they need the rows' sampling table (a greedy row's temperature 0).
static std::unique_ptr<StepPenalties> penalties_of(const Opt& settings, const Opt& tallies, const StepDraws& how,
                                                   int64_t rows, const char* who) {
  TORCH_CHECK(settings.has_value() == tallies.has_value(), who, ": penalties and their tallies come together");
  if (!settings) return nullptr;
  TORCH_CHECK(how.table.has_value(), who, ": penalties need the rows' sampling table");
  auto pen = std::make_unique<StepPenalties>(*settings, *tallies, rows, who);
  if (pen->rows.empty()) return nullptr;
  return pen;
}

// A call's draws, (steps, rows) each: the ids, each argmax's logit, each row's log-sum-exp, each drawn token's logit.
struct Draws {
  torch::Tensor ids, top, logsum, picked;
  Draws(int64_t steps, int64_t rows)
      : ids(torch::empty({steps, rows}, torch::kLong)),
        top(torch::empty({steps, rows}, torch::kFloat)),
        logsum(torch::empty({steps, rows}, torch::kFloat)),
        picked(torch::empty({steps, rows}, torch::kFloat)) {}
  void put(int64_t k, const std::vector<torch::Tensor>& found) {  // step k's, as layers_and_draw gave them
    const int64_t rows = ids.size(1);
    std::copy_n(found[0].data_ptr<int64_t>(), rows, ids.data_ptr<int64_t>() + k * rows);
    std::copy_n(found[1].data_ptr<float>(), rows, top.data_ptr<float>() + k * rows);
    std::copy_n(found[2].data_ptr<float>(), rows, logsum.data_ptr<float>() + k * rows);
    std::copy_n(found[3].data_ptr<float>(), rows, picked.data_ptr<float>() + k * rows);
  }
};

// A single stage's decode call, all its steps after the first in one call: step k embeds the tokens step k - 1 drew
// (`ids` for step 0), runs stack `id`'s layers at slots[k] and positions[k] (steps x rows each), then the head
// (head_block: the final norm, weights w, bias b, int8 scales s) and each row's draw (layers_and_draw: greedy, or as
// `table` and `seeds` say, after the rows' `penalties` where given, counted from `tallies` and the call's own draws:
// StepPenalties). Returns the drawn ids, each argmax's logit, the log of its row's exponentials' sum and
// each drawn token's logit, each (steps, rows): what sampling.sample computes at each step, so a token's
// log-probability is (the last - the second) - the third; and each step's start and end (steps, 2) on steady_clock,
// which is Python's time.perf_counter. Why: between two steps a worker returned to Python for the step's bookkeeping
// and the draw, ~0.25 ms a token of a ~10-20 ms step, all of it on the only stage's critical path (docs/performance.md,
// "A single stage's greedy steps in one call").
std::vector<torch::Tensor> decode_steps_drawn(int64_t id, torch::Tensor ids, torch::Tensor embed, torch::Tensor slots,
                                              torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                              torch::Tensor norm, double eps, Weights w, Opt b, Opt s, Opt table,
                                              Opt seeds, Opt penalties, Opt tallies, Opt top_counts) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && (slots.dim() == 2 || slots.dim() == 3) &&
                  positions.dim() == 2 && slots.size(0) == positions.size(0) && slots.size(1) == positions.size(1) &&
                  slots.size(1) == ids.size(0) && slots.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "decode_steps_drawn: ids must be (rows) int64, positions (steps, rows) int64 and slots (steps, rows) or "
              "block tables (steps, rows, blocks) int64, not ", ids.sizes(), ", ", slots.sizes(), " and ",
              positions.sizes());
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "decode_steps_drawn: the embedding must be contiguous");
  const auto held = held_stack(id, "decode_steps_drawn");
  const int64_t steps = slots.size(0), rows = ids.size(0);
  const StepDraws how(table, seeds, rows, "decode_steps_drawn");
  const auto pen = penalties_of(penalties, tallies, how, rows, "decode_steps_drawn");
  StepTops tops(top_counts, steps, rows, w.empty() ? 0 : out_features(w), "decode_steps_drawn");
  Draws drawn(steps, rows);
  const auto slots_c = slots.contiguous(), positions_c = positions.contiguous();
  auto in = torch::empty({rows, embed.size(1)}, embed.options());
  auto times = torch::empty({steps, 2}, torch::kDouble);
  double* stamp = times.data_ptr<double>();
  torch::Tensor feed = ids.contiguous();
  for (int64_t k = 0; k < steps; ++k) {
    stamp[2 * k] = since_epoch(std::chrono::steady_clock::now());
    embed_rows(embed, feed.data_ptr<int64_t>(), rows, in.data_ptr(), "decode_steps_drawn");
    const auto found = layers_and_draw(*held, in, slots_c[k], positions_c[k], cos, sin, norm, eps, w, b, s, how,
                                       pen.get(), tops, k);
    drawn.put(k, found);
    feed = found[0];
    stamp[2 * k + 1] = since_epoch(std::chrono::steady_clock::now());
  }
  return {drawn.ids, drawn.top, drawn.logsum, drawn.picked, times, tops.ids, tops.values};
}

// decode_layers whose input comes over a pipeline link, received inside this call, and whose output may go on over the
// next one from here too. A link's arguments are the shared-memory link's function (link_recv's or link_send's
// address, from `shm_link`) and the rest of its arguments after the tensor it moves. A later stage receives the
// activations into x; the first stage (`embed` given) receives the token ids into `ids` and embeds them into x. With
// `send`, the layers' output is sent on, then written to `log` (the stage's activation log, slots by positions), if
// given. Returns (x through the layers, the receive's status, the seconds it waited, when its message was there on
// steady_clock, which is Python's time.perf_counter, the send's status, the seconds the send took); on a failed receive
// x as it was, and nothing sent. Why: a stage waits through the other stage's turn, and a receive returned to Python
// before the forward's call was made. That Python, the call's argument conversion and the first layer's norm ran after
// the message came, cold, on the critical path of every token: ~0.2 ms a hop here. Made before the wait, they are off
// it; and a send and log write from Python held a vCPU the woken next stage wanted (docs/performance.md).
using LinkArgs = std::tuple<int64_t, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double,
                            double>;
using LinkCall = int64_t (*)(torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             double, double);
static int64_t call_link(const LinkArgs& a, const torch::Tensor& x) {
  TORCH_CHECK(std::get<0>(a) != 0, "a layers' call over a link: no link function to call");
  return reinterpret_cast<LinkCall>(std::get<0>(a))(std::get<1>(a), x, std::get<2>(a), std::get<3>(a),
                                                    std::get<4>(a), std::get<5>(a), std::get<6>(a), std::get<7>(a),
                                                    std::get<8>(a), std::get<9>(a));
}

std::tuple<torch::Tensor, int64_t, double, double, int64_t, double> decode_layers_received(
    int64_t id, torch::Tensor x, Opt embed, Opt ids, torch::Tensor slots, torch::Tensor positions, torch::Tensor cos,
    torch::Tensor sin, LinkArgs recv, c10::optional<LinkArgs> send, Opt log) {
  TORCH_CHECK(embed.has_value() == ids.has_value(), "decode_layers_received: embed and ids come together");
  const auto held = held_stack(id, "decode_layers_received");
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int64_t status = call_link(recv, embed ? *ids : x);
  const auto t1 = Clock::now();
  const double waited = std::chrono::duration<double>(t1 - t0).count();
  const double arrived = since_epoch(t1);
  if (status != 0) return {x, status, waited, arrived, 0, 0.0};
  if (embed) embed_rows(*embed, ids->data_ptr<int64_t>(), ids->numel(), x.data_ptr(), "decode_layers_received");
  run_stack(*held, x, slots, positions, cos, sin, true, [&](torch::Tensor& y) {
    x = y;
    return int64_t{0};
  });
  if (!send) return {x, 0, waited, arrived, 0, 0.0};
  x = x.contiguous();
  const auto t2 = Clock::now();
  const int64_t sent = call_link(*send, x);
  const double sending = std::chrono::duration<double>(Clock::now() - t2).count();
  if (sent == 0 && log) {  // as the log's own write does it, after the rows are on their way
    const int64_t row = x.size(1) * x.element_size(), per_slot = log->size(1);
    TORCH_CHECK(log->is_contiguous() && log->scalar_type() == x.scalar_type() && log->size(2) == x.size(1),
                "decode_layers_received: the log is not a contiguous (slots, positions, ", x.size(1), ") ",
                x.scalar_type(), " tensor");
    const int64_t* slot_of = slots.data_ptr<int64_t>();
    const int64_t* position_of = positions.data_ptr<int64_t>();
    auto* dst = static_cast<uint8_t*>(log->data_ptr());
    const auto* src = static_cast<const uint8_t*>(x.data_ptr());
    for (int64_t i = 0; i < x.size(0); ++i) {
      TORCH_CHECK(0 <= slot_of[i] && slot_of[i] < log->size(0) && 0 <= position_of[i] && position_of[i] < per_slot,
                  "decode_layers_received: row ", i, " is out of the log");
      std::memcpy(dst + (slot_of[i] * per_slot + position_of[i]) * row, src + i * row, row);
    }
  }
  return {x, 0, waited, arrived, sent, sending};
}

// decode_steps_drawn on a pipeline's last stage: step k receives its activations over `recv` (message seq + k of that
// link), runs the layers at slots[k] and positions[k], the head and the draw, and sends the drawn ids back to the first
// stage over `send` (the loop link, message seq + k), but the last step's, which the call's reply carries. Stops at the
// first receive or send that fails. Returns (drawn ids, argmax logits, log-sum-exps, drawn logits, each (steps,
// rows); a (steps, 6) float64 tensor of each step's receive status, wait, arrival and end of its draw on steady_clock,
// send status and send seconds, rows past a failed step zero; the steps done whole). Why: the draw and the step's
// bookkeeping in Python stood between the head and the send of the tokens the first stage waits for.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, torch::Tensor,
           torch::Tensor>
decode_steps_drawn_received(int64_t id, torch::Tensor x, torch::Tensor slots, torch::Tensor positions,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor norm, double eps, Weights w, Opt b,
                            Opt s, LinkArgs recv, LinkArgs send, Opt table, Opt seeds, Opt penalties, Opt tallies,
                            Opt top_counts) {
  TORCH_CHECK((slots.dim() == 2 || slots.dim() == 3) && positions.dim() == 2 &&
                  slots.size(0) == positions.size(0) && slots.size(1) == positions.size(1) &&
                  slots.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slots.size(1) == x.size(0),
              "decode_steps_drawn_received: positions must be (steps, ", x.size(0), ") int64 and slots (steps, ",
              x.size(0), ") or block tables (steps, ", x.size(0), ", blocks) int64, not ", slots.sizes(), " and ",
              positions.sizes());
  const auto held = held_stack(id, "decode_steps_drawn_received");
  const int64_t steps = slots.size(0), rows = x.size(0);
  const StepDraws how(table, seeds, rows, "decode_steps_drawn_received");
  const auto pen = penalties_of(penalties, tallies, how, rows, "decode_steps_drawn_received");
  StepTops tops(top_counts, steps, rows, w.empty() ? 0 : out_features(w), "decode_steps_drawn_received");
  Draws drawn(steps, rows);
  auto times = torch::empty({steps, 6}, torch::kDouble);
  double* t = times.data_ptr<double>();
  std::fill(t, t + 6 * steps, 0.0);
  const auto slots_c = slots.contiguous(), positions_c = positions.contiguous();
  using Clock = std::chrono::steady_clock;
  int64_t done = 0;
  for (int64_t k = 0; k < steps; ++k) {
    double* row = t + 6 * k;
    LinkArgs in_k = recv, out_k = send;
    std::get<2>(in_k) += k;
    std::get<2>(out_k) += k;
    const auto t0 = Clock::now();
    const int64_t status = call_link(in_k, x);
    const auto t1 = Clock::now();
    row[0] = static_cast<double>(status), row[1] = std::chrono::duration<double>(t1 - t0).count();
    row[2] = since_epoch(t1);
    if (status != 0) break;
    const auto found = layers_and_draw(*held, x, slots_c[k], positions_c[k], cos, sin, norm, eps, w, b, s, how,
                                       pen.get(), tops, k);
    drawn.put(k, found);
    const auto t2 = Clock::now();
    row[3] = since_epoch(t2);
    if (k + 1 < steps) {  // the first stage's next step waits for these; the last step's go back in the reply
      const int64_t sent = call_link(out_k, found[0]);
      row[4] = static_cast<double>(sent), row[5] = std::chrono::duration<double>(Clock::now() - t2).count();
      if (sent != 0) break;
    }
    ++done;
  }
  return {drawn.ids, drawn.top, drawn.logsum, drawn.picked, times, done, tops.ids, tops.values};
}

// decode_layers for a tensor-parallel rank whose row-parallel products have no bias: each half's partial sum goes
// to `reduce`, the shared-memory collective's shm_all_reduce_add (its address, from `shm_collective`), given the
// rest of its arguments, which writes x + the sum over ranks over it, as CpuDecode's call per half does through
// `ShmCollective.all_reduce_add`. Collective j of the call is number seq + j + 1. (x, the status of the last
// collective made, how many were made, the seconds spent in them): on a failure, x as it was before that half.
// Why: a rank otherwise returned to Python twice a layer, and on a host where two ranks share a core (tp=3 on two)
// every microsecond of it delays both (docs/performance.md).
constexpr int64_t NOT_CARRIED = @NOT_CARRIED@;  // shm_all_reduce_add's refusal (shm_collective.NOT_CARRIED)
using ReduceAdd = int64_t (*)(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t,
                              int64_t, torch::Tensor, double, double);
std::tuple<torch::Tensor, int64_t, int64_t, double> decode_layers_reduced(
    int64_t id, torch::Tensor x, torch::Tensor slots, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
    int64_t reduce, torch::Tensor seg, int64_t rank, int64_t size, int64_t seq, int64_t capacity, int64_t data_offset,
    torch::Tensor pids, double spin_s, double timeout_s) {
  TORCH_CHECK(reduce != 0, "decode_layers_reduced: no all-reduce to call");
  const auto all_reduce_add = reinterpret_cast<ReduceAdd>(reduce);
  const auto held = held_stack(id, "decode_layers_reduced");
  int64_t done = 0;
  double waited = 0;
  // partial := x + the sum of every rank's partial, then x := partial; on a failure x stays as it was.
  const int64_t status = run_stack(*held, x, slots, positions, cos, sin, false, [&](torch::Tensor& partial) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t status = all_reduce_add(seg, partial, x, rank, size, seq + done + 1, capacity, data_offset, pids,
                                          spin_s, timeout_s);
    waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    TORCH_CHECK(status != NOT_CARRIED, "decode_layers_reduced: the all-reduce refused a ", partial.scalar_type(),
                " partial sum of ", partial.numel(), " values (", capacity, "-byte slots)");
    ++done;
    if (status == 0) x = partial;
    return status;
  });
  return {x, status, done, waited};
}

// `linear.quantize_groups` in one pass over the weights instead of some twenty float64 tensors of them: the same
// grids, roundings and choice, so the same int8 values and float16 scales (the two grids' errors are summed in
// another order than torch's, which could only decide between two grids whose errors tie to the last bit).
// Contraction off: q * s + m is a product then a sum, each rounded, as torch computes them; an FMA would round once.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {
struct Grid {
  at::Half s, m;
};

// The squared error of x[0..group) on the grid (s, m), its levels 0..255 into q.
double fit_grid(const double* x, int64_t group, Grid grid, double* q) {
  const double s = static_cast<float>(grid.s), m = static_cast<float>(grid.m);
  double error = 0;
  for (int64_t i = 0; i < group; ++i) {
    const double level = std::min(std::max(std::nearbyint((x[i] - m) / s), 0.0), 255.0);
    const double d = level * s + m - x[i];
    q[i] = level;
    error += d * d;
  }
  return error;
}

template <typename T>
void quantize_row(const T* row, int64_t in_f, int64_t group, int8_t* values, at::Half* scale, double* x, double* q,
                  double* q2) {
  const int64_t groups = (in_f + group - 1) / group;
  const double tiny = 6.103515625e-05;  // float16's smallest normal
  const double last = static_cast<float>(row[in_f - 1]);  // pads the last group: changes neither its min nor its max
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t start = g * group, n = std::min(group, in_f - start);
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (int64_t i = 0; i < group; ++i) {
      x[i] = i < n ? static_cast<double>(static_cast<float>(row[start + i])) : last;
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    const at::Half sym_s = static_cast<float>(std::max(std::max(hi, -lo) / 127, tiny));
    const Grid sym{sym_s, static_cast<float>(-128.0f * static_cast<float>(sym_s))};
    const Grid asym{static_cast<float>(std::max((hi - lo) / 255, tiny)), static_cast<float>(lo)};
    const double e_sym = fit_grid(x, group, sym, q), e_asym = fit_grid(x, group, asym, q2);
    const bool use_asym = e_asym < e_sym;
    const double* levels = use_asym ? q2 : q;
    for (int64_t i = 0; i < n; ++i) values[start + i] = static_cast<int8_t>(levels[i] - 128);
    const Grid chosen = use_asym ? asym : sym;
    scale[2 * g] = chosen.s;
    scale[2 * g + 1] = chosen.m;
  }
}
}  // namespace

// weight (rows, in) float32, bfloat16 or float16, contiguous -> values (rows, in) int8 and scale (rows, groups, 2)
// float16, written in place.
void quantize_groups(torch::Tensor weight, torch::Tensor values, torch::Tensor scale, int64_t group) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) > 0 && group > 0,
              "quantize_groups: a contiguous 2-D weight with inputs, and a group size");
  const int64_t rows = weight.size(0), in_f = weight.size(1), groups = (in_f + group - 1) / group;
  TORCH_CHECK(values.scalar_type() == at::kChar && values.is_contiguous() && values.dim() == 2 &&
                  values.size(0) == rows && values.size(1) == in_f,
              "quantize_groups: values must be a contiguous int8 (rows, in) tensor");
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.is_contiguous() && scale.numel() == rows * groups * 2,
              "quantize_groups: scale must be a contiguous float16 (rows, groups, 2) tensor");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "quantize_groups", [&] {
    const scalar_t* w = weight.data_ptr<scalar_t>();
    int8_t* v = values.data_ptr<int8_t>();
    at::Half* s = scale.data_ptr<at::Half>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      std::vector<double> work(3 * group);
      for (int64_t r = begin; r < end; ++r)
        quantize_row(w + r * in_f, in_f, group, v + r * in_f, s + r * groups * 2, work.data(), work.data() + group,
                     work.data() + 2 * group);
    });
  });
}
#pragma GCC pop_options
"""

# Why a sampled row cannot be drawn, in every way of drawing's error (`sampling.draw`'s, and the C++ calls' of several
# steps, which `cpu_decode` turns into the same ValueError).
NOT_FINITE = "logits hold a NaN or no finite value"

# What `SHARDMESH_CPU_ISA` may ask for: "native" (the default) compiles for this CPU, taking the widest paths it has;
# "avx512" leaves AVX512-BF16 and AMX out, as on the Skylake-SP to Ice Lake servers that have AVX-512 without them;
# "avx2" leaves AVX-512 and AMX out. A CPU with more runs (and tests, and measures) those paths too.
ISA_ENV = "SHARDMESH_CPU_ISA"
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_FLAGS = {
    "native": ["-O3", "-march=native", "-fopenmp-simd"],
    "avx512": ["-O3", "-march=native", "-mno-avx512bf16", *NO_AMX, "-fopenmp-simd"],
    "avx2": ["-O3", "-march=native", "-mno-avx512f", *NO_AMX, "-fopenmp-simd"],
}


def isa_kernel(isa: str) -> InlineKernel:
    """The kernels compiled for `isa` (a key of ISA_FLAGS); each is built once per machine and cached."""
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISA_FLAGS)}")
    if isa not in _KERNELS:
        source = (_SOURCE.replace("@ROW@", int8_cpu.ROW_SOURCE).replace("@GROUP@", str(INT8_GROUP))
                  .replace("@NOT_CARRIED@", str(shm_collective.NOT_CARRIED))
                  .replace("@NOT_FINITE@", NOT_FINITE))  # fmt: skip
        _KERNELS[isa] = InlineKernel(
            "shardmesh_cpu", source.replace("@AMX_ENV@", AMX_ENV),
            ["linear", "rows_linear", "attention_block", "mlp_block", "stack_layers", "decode_layers",
             "decode_layers_reduced", "decode_layers_received", "decode_steps_drawn", "decode_steps_drawn_received",
             "drop_layers", "head_block", "greedy_rows", "top_rows", "sample_rows", "bf16_rows_ways", "bf16_rows",
             "set_bf16_rows", "bf16_rows_probe", "set_attend_segment", "quantize_groups"],
            ISA_FLAGS[isa],
        )  # fmt: skip
    return _KERNELS[isa]


def _isa_from_env() -> str:
    """$SHARDMESH_CPU_ISA, or "native" (with a warning) when it names no build."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        structlog.get_logger().warning("cpu_isa_ignored", env=ISA_ENV, value=isa, expected=sorted(ISA_FLAGS),
                                       using="native")  # fmt: skip
        return "native"
    return isa


_KERNELS: dict[str, InlineKernel] = {}
_KERNEL = isa_kernel(_isa_from_env())

# bfloat16 products of two rows or more on AVX512-BF16 without AMX tiles: "vdpbf16ps", "widened" (the weights widened
# to float32 for FMAs), or "auto" (the default): the faster on this core, timed once per process (`choose_bf16_rows`).
BF16_ROWS_ENV = "SHARDMESH_CPU_BF16_ROWS"
BF16_ROWS_WAYS = ("vdpbf16ps", "widened")
# Widened is taken where the probe times it below this fraction of vdpbf16ps: 0.58 on the Xeon of family 6 model 207
# (16-row steps 0.77x the time), where a Zen 4's vdpbf16ps runs at twice its FMAs' rate; a core near even keeps
# vdpbf16ps, which needs half the instructions.
WIDEN_BELOW = 0.9
PROBE_PAIRS = 288  # SmolLM2's hidden width in pairs: a block of 36 KiB, in L1 on any AVX-512 core


@dataclass(frozen=True)
class Bf16Rows:
    """How this process multiplies bfloat16 weights by several rows, and why."""

    way: str  # "amx", "vdpbf16ps" or "widened"
    reason: str
    vdpbf16ps_ns: float | None = None  # the probe's time per pass of 8 rows over a block in L1, where it ran
    widened_ns: float | None = None


_BF16_ROWS: dict[str, Bf16Rows] = {}  # per build (`isa_kernel`): each extension holds its own way


def choose_bf16_rows() -> Bf16Rows:
    """Set and return the way bfloat16 products of several rows run in this process (once; the loader calls it for a
    bfloat16 shard on the blocked kernels): AMX tiles where the CPU lets this process use them; else, on AVX512-BF16,
    `$SHARDMESH_CPU_BF16_ROWS` when it names a way, or the faster of vdpbf16ps and widened by a probe of a few
    milliseconds (`WIDEN_BELOW`); else widened, the only way this build has. Both ways give the same numbers (the C++
    says why), so the choice changes speed only. A bad value of the variable is a ValueError naming it."""
    if _KERNEL.name not in _BF16_ROWS:
        chosen = _choose_bf16_rows(os.environ.get(BF16_ROWS_ENV) or "auto")
        structlog.get_logger().info("bf16_rows_chosen", **dataclasses.asdict(chosen))
        _BF16_ROWS[_KERNEL.name] = chosen
    return _BF16_ROWS[_KERNEL.name]


def use_bf16_rows(way: str) -> None:
    """Make bfloat16 products of several rows run `way` ("vdpbf16ps" or "widened") from now on, in this process: for
    tests and benchmarks comparing the two (`choose_bf16_rows` picks for serving). A way this build lacks is a
    RuntimeError."""
    module().set_bf16_rows(way)  # type: ignore[attr-defined]
    _BF16_ROWS[_KERNEL.name] = Bf16Rows(way, "asked for")


def _choose_bf16_rows(asked: str) -> Bf16Rows:
    if asked not in ("auto", *BF16_ROWS_WAYS):
        raise ValueError(f"{BF16_ROWS_ENV}={asked!r}: expected auto, {' or '.join(BF16_ROWS_WAYS)}")
    ext = module()
    ways = ext.bf16_rows_ways()  # type: ignore[attr-defined]
    if "amx" in ways:
        return Bf16Rows("amx", "AMX tiles (SHARDMESH_CPU_AMX=0 turns them off)")
    if "vdpbf16ps" not in ways:
        return Bf16Rows("widened", "no AVX512-BF16 in this build")
    if asked != "auto":
        ext.set_bf16_rows(asked)  # type: ignore[attr-defined]
        return Bf16Rows(asked, f"{BF16_ROWS_ENV}={asked}")
    dp, widened = ext.bf16_rows_probe(PROBE_PAIRS, 200, 5)  # type: ignore[attr-defined]
    way = "widened" if widened < WIDEN_BELOW * dp else "vdpbf16ps"
    ext.set_bf16_rows(way)  # type: ignore[attr-defined]
    return Bf16Rows(way, f"probe: widened {widened / dp:.2f}x vdpbf16ps's time (widened below {WIDEN_BELOW}x)",
                    round(dp, 1), round(widened, 1))  # fmt: skip


def available() -> bool:
    """Whether the kernels are built (building them now if they are not cached)."""
    return _KERNEL.module() is not None


def build_error() -> str:
    """Why the kernels could not be built ("" when they were, or were not tried)."""
    return _KERNEL.build_error


def loaded() -> bool:
    """Whether the kernels are built and loaded in this process already (never starts a build)."""
    return _KERNEL.ext is not None


def quantize_groups(weight: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """`linear.quantize_groups` of a float32, bfloat16 or float16 host weight (out, in), in one pass (see there)."""
    rows, in_f = weight.shape
    values = torch.empty(rows, in_f, dtype=torch.int8)
    scale = torch.empty(rows, -(-in_f // group), 2, dtype=torch.float16)
    module().quantize_groups(weight.contiguous(), values, scale, group)  # type: ignore[attr-defined]
    return values, scale


def greedy_rows(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For each row of a (rows, n) float32 tensor: the index of its first largest value (the first NaN where there is
    one), as `x.argmax(-1)`; the largest value; and the log of the sum of exp(value - largest). Any entry's
    log-probability is (its value - the largest) - the last, as `log_softmax` computes it (the argmax's: minus the
    last; all NaN where the largest is not finite, as log_softmax's row then is)."""
    ids, top, logsum = module().greedy_rows(x)  # type: ignore[attr-defined]
    return ids, top, logsum


def top_rows(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Each row's k largest values of a (rows, n) float32 tensor and their indices, largest first, a tie going to the
    lower index and NaN above every number (`sampling.top_tokens`' order): (values, ids), (rows, k) each."""
    values, ids = module().top_rows(x, k)  # type: ignore[attr-defined]
    return values, ids


def sample_rows(x: Tensor, table: Tensor, u: Tensor) -> Tensor:
    """Each row's draw as `sampling.draw` defines it, of (rows, n) float32 logits, each row's settings (`table`, as
    `sampling.draw_table` lays them out, every temperature above 0) and its uniform in [0, 1) (float64): (rows,) int64
    token ids, -1 for a row whose logits hold a NaN or no finite value."""
    return module().sample_rows(x, table, u)  # type: ignore[attr-defined]


def module() -> object:
    """The built extension (`available()` must be True)."""
    ext = _KERNEL.module()
    assert ext is not None, build_error()
    return ext


def pack(weight: Tensor) -> Tensor:
    """W (N, K), float32, bfloat16 or int8, in blocks of NB output features, as an (N, K) view of the blocked buffer:
    float32 and int8 blocks (K, NB), bfloat16 blocks (K/2, NB, 2) with K padded to even. Rows past N are zeros.
    The blocks are written straight from `weight`: one matrix's worth of memory beside it while loading, not two."""
    n, k = weight.shape
    blocks, whole = -(-n // NB), n // NB
    if weight.dtype in (torch.float32, torch.int8):
        buffer = torch.zeros(blocks, k, NB, dtype=weight.dtype)
        buffer[:whole] = weight[: whole * NB].reshape(whole, NB, k).transpose(1, 2)
        if whole < blocks:  # the last block's rows past N stay zero
            buffer[whole, :, : n - whole * NB] = weight[whole * NB :].t()
    elif weight.dtype == torch.bfloat16:
        k2 = -(-k // 2)
        if k % 2:  # odd K (rare): pad a copy to even, then block it
            padded = torch.zeros(blocks * NB, 2 * k2, dtype=weight.dtype)
            padded[:n, :k] = weight
            weight = padded
        buffer = torch.zeros(blocks, k2, NB, 2, dtype=weight.dtype)
        buffer[:whole] = weight[: whole * NB].reshape(whole, NB, k2, 2).transpose(1, 2)
        if whole < blocks:
            rest = weight[whole * NB : n]
            buffer[whole, :, : rest.shape[0]] = rest.reshape(rest.shape[0], k2, 2).transpose(0, 1)
    else:
        raise ValueError(f"blocked weights are float32, bfloat16 or int8, not {weight.dtype}")
    return buffer.view(-1).as_strided((n, k), (k, 1))


def unpack(packed: Tensor) -> Tensor:
    """The (N, K) values of a `pack`ed weight, as a new contiguous tensor."""
    n, k = packed.shape
    blocks = -(-n // NB)
    flat = torch.empty(0, dtype=packed.dtype).set_(packed.untyped_storage())
    if packed.dtype in (torch.float32, torch.int8):
        dense = flat[: blocks * k * NB].view(blocks, k, NB).transpose(1, 2).reshape(blocks * NB, k)
    else:
        k2 = -(-k // 2)
        dense = flat[: blocks * k2 * NB * 2].view(blocks, k2, NB, 2).permute(0, 2, 1, 3).reshape(blocks * NB, 2 * k2)
    return dense[:n, :k].contiguous()


def pack_groups(scale: Tensor) -> Tensor:
    """int8 groups' (N, groups, 2) float16 scales and minima (`linear.quantize_groups`) in the blocks of `pack`: block
    b's (groups, 2, NB), scales then minima of its NB output features, rows past N zeros; returned as an
    (N, groups, 2) view of the blocked buffer, as `pack` returns its weights."""
    n, groups, _ = scale.shape
    blocks = -(-n // NB)
    padded = torch.zeros(blocks * NB, groups, 2, dtype=torch.float16)
    padded[:n] = scale
    buffer = padded.view(blocks, NB, groups, 2).permute(0, 2, 3, 1).contiguous()
    return buffer.view(-1).as_strided((n, groups, 2), (groups * 2, 2, 1))


def unpack_groups(packed: Tensor) -> Tensor:
    """The (N, groups, 2) scales and minima of a `pack_groups` buffer, as a new contiguous tensor."""
    n, groups, _ = packed.shape
    blocks = -(-n // NB)
    flat = torch.empty(0, dtype=packed.dtype).set_(packed.untyped_storage())
    blocked = flat[: blocks * groups * 2 * NB].view(blocks, groups, 2, NB)
    return blocked.permute(0, 3, 1, 2).reshape(blocks * NB, groups, 2)[:n].contiguous()


def rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) float32 times a float32 weight (N, K) whose rows are contiguous (as stored, or a column slice of
    stored rows; not packed), + bias -> (..., N)."""
    rows = x.reshape(-1, x.shape[-1])
    y = module().rows_linear(rows, weight, bias)  # type: ignore[attr-defined]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear(x: Tensor, packed: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
    """x (..., K) times a `pack`ed weight (N, K) (int8: with its groups' `pack_groups` scales and offsets), + bias
    -> (..., N) in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    y = module().linear(rows, packed, bias, scale)  # type: ignore[attr-defined]
    return y.reshape(*x.shape[:-1], packed.shape[0])
