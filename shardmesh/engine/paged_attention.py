"""Decode attention over a paged KV cache: each sequence's one new query against its blocks, read in place.

A decode step gives every sequence one new token whose query must see the sequence's whole history, which a
paged cache (`kv_cache.PagedKVCache`) keeps in blocks scattered over the pool. Gathering them into one tensor
per step for SDPA copies the whole history of every sequence per layer; the kernel here reads the blocks where
they are instead. One task per (sequence, kv head), parallel with PyTorch's threads (`at::parallel_for`: OpenMP
in PyTorch's CPU builds, following `torch.set_num_threads`); each walks the sequence's block table with an online
softmax (running max and sum, the accumulator rescaled when the max grows: FlashAttention's and vLLM's
PagedAttention's scheme), 64 positions (a span of blocks) per softmax step, in float32 whatever the cache dtype
(float32, bfloat16, float16).

Why it is shaped so (measured on SmolLM2's shapes, 16 sequences of ~500 tokens, blocks of 16, one thread):
- The query heads that share a kv head (grouped-query attention: 3 for SmolLM2) are computed together, up to four
  at a time, so each key and value row is loaded once for all of them.
- Keys are stored transposed within a block, a (head_dim, block_size) tile per block and kv head (vLLM's key
  cache likewise puts the block's positions inside head_dim, (head_dim / x, block_size, x)): 16 positions' scores
  are then one vector of lanes summed over head_dim, with no horizontal sums. Values stay (block_size, head_dim).
- Sums are GCC/Clang vector-extension values, kept in registers; the exponentials a polynomial on those vectors.
  The same loops on plain arrays with `#pragma omp simd` kept the sums on the stack and called expf per element:
  0.86 against 0.39 ms per layer with the blocks in cache, 1.29x against 0.92x the slot cache's SDPA over 30 layers.
- No software prefetch: fetching the next block's tiles gained 13% on an earlier, slower version of these loops
  and was not measured again on these; the blocks' order mattered nothing there (shuffled ids as fast as in order).

Built by `native.InlineKernel` (as `int8_cpu` is: `torch.utils.cpp_extension.load_inline`) at first use, cached under
`~/.cache/torch_extensions` by a digest of the source and the CPU's flags (`-march=native`). Where it cannot be
built (no compiler or ninja), or off the CPU, `choose` returns `GatherDecode`: the blocks gathered into a
contiguous tensor and SDPA, correct but copying. The choice is named (`name`), as the linear kernels are.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from shardmesh.engine.native import InlineKernel

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// W float lanes as one value (GCC/Clang vector extensions): held in a vector register, so the sums below stay in
// registers (plain arrays and `omp simd` left them on the stack, measured: twice the time).
constexpr int64_t W = 16;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

template <typename T>
inline vf load_lanes(const T* p) {  // W elements of any dtype as float32
  float t[W];
  for (int64_t w = 0; w < W; ++w) t[w] = static_cast<float>(p[w]);
  vf r;
  std::memcpy(&r, t, sizeof r);
  return r;
}
template <>
inline vf load_lanes<float>(const float* p) {
  vf r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
template <>
inline vf load_lanes<c10::BFloat16>(const c10::BFloat16* p) {  // bfloat16 is float32's upper 16 bits
  typedef uint16_t vh __attribute__((vector_size(W * sizeof(uint16_t))));
  typedef uint32_t vu __attribute__((vector_size(W * sizeof(uint32_t))));
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline float lane_max(vf v) {
  float t[W], r = -std::numeric_limits<float>::infinity();
  std::memcpy(t, &v, sizeof t);
  for (int64_t w = 0; w < W; ++w) r = std::max(r, t[w]);
  return r;
}
inline float lane_sum(vf v) {
  float t[W], r = 0.f;
  std::memcpy(t, &v, sizeof t);
  for (int64_t w = 0; w < W; ++w) r += t[w];
  return r;
}

// exp(x) for x <= 0 as 2^k * p(r), x = k ln2 + r, |r| <= ln2 / 2 (Cephes' expf polynomial: ~1 ulp), W lanes at a
// time (std::exp is a call per element). Below -87 it gives ~1e-38, not 0.
inline vf exp_nonpositive(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf k = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - k * 0.693359375f + k * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

constexpr int64_t SPAN = 64;  // positions per softmax step: several small blocks share one max, rescale and sum

// Scores of GC queries (rows of q, HD apart) against positions [0, n) of one block: s[c * ss + t] = q_c . key t.
// Keys are transposed ((HD, BS) tile: row x is dimension x of the BS positions), so W positions are W lanes summed
// over x, each key row loaded once for the GC queries; two sums per query in flight (even and odd x).
template <typename scalar_t, int GC>
inline void block_scores(const float* q, const scalar_t* kb, int64_t n, int64_t BS, int64_t HD, float* s,
                         int64_t ss) {
  int64_t t = 0;
  for (; t < n && t + W <= BS; t += W) {  // lanes past n, still inside the tile, are computed and not used
    vf a0[GC], a1[GC];
    for (int c = 0; c < GC; ++c) a0[c] = a1[c] = vf{};
    int64_t x = 0;
    for (; x + 2 <= HD; x += 2) {
      const vf k0 = load_lanes(kb + x * BS + t), k1 = load_lanes(kb + (x + 1) * BS + t);
      for (int c = 0; c < GC; ++c) {
        a0[c] += q[c * HD + x] * k0;
        a1[c] += q[c * HD + x + 1] * k1;
      }
    }
    for (; x < HD; ++x) {
      const vf k0 = load_lanes(kb + x * BS + t);
      for (int c = 0; c < GC; ++c) a0[c] += q[c * HD + x] * k0;
    }
    for (int c = 0; c < GC; ++c) store(s + c * ss + t, a0[c] + a1[c]);
  }
  for (; t < n; ++t)  // a block size that is not a multiple of W
    for (int c = 0; c < GC; ++c) {
      float a = 0.f;
      for (int64_t x = 0; x < HD; ++x) a += q[c * HD + x] * static_cast<float>(kb[x * BS + t]);
      s[c * ss + t] = a;
    }
}

// acc[c * HD + x] += sum_i p[c * ps + i] * value i [x] over positions [0, n) of one block ((BS, HD) tile), for GC
// queries: W dimensions at a time, each value row loaded once for the GC queries, even and odd positions apart.
template <typename scalar_t, int GC>
inline void block_values(const float* p, int64_t ps, const scalar_t* vb, int64_t n, int64_t HD, float* acc) {
  int64_t x = 0;
  for (; x + W <= HD; x += W) {
    vf a0[GC], a1[GC];
    for (int c = 0; c < GC; ++c) a0[c] = a1[c] = vf{};
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      const vf v0 = load_lanes(vb + i * HD + x), v1 = load_lanes(vb + (i + 1) * HD + x);
      for (int c = 0; c < GC; ++c) {
        a0[c] += p[c * ps + i] * v0;
        a1[c] += p[c * ps + i + 1] * v1;
      }
    }
    for (; i < n; ++i) {
      const vf v0 = load_lanes(vb + i * HD + x);
      for (int c = 0; c < GC; ++c) a0[c] += p[c * ps + i] * v0;
    }
    for (int c = 0; c < GC; ++c) store(acc + c * HD + x, load_lanes(acc + c * HD + x) + a0[c] + a1[c]);
  }
  for (; x < HD; ++x)  // a head_dim that is not a multiple of W
    for (int c = 0; c < GC; ++c) {
      float a = 0.f;
      for (int64_t i = 0; i < n; ++i) a += p[c * ps + i] * static_cast<float>(vb[i * HD + x]);
      acc[c * HD + x] += a;
    }
}

// One (sequence, kv head) for GC of its query heads (q, acc: GC rows of HD; m, l: GC running maxima and sums):
// the online softmax over its blocks, SPAN positions (a span of blocks) at a time.
template <typename scalar_t, int GC>
void attend_blocks(const float* q, const scalar_t* kc, const scalar_t* vc, const int32_t* table, int64_t len,
                   int64_t kh, int64_t KVH, int64_t BS, int64_t HD, float* s, float* acc, float* m, float* l) {
  const int64_t span = std::max<int64_t>(1, SPAN / BS);  // blocks per softmax step
  const int64_t ss = span * BS;
  const int64_t nb = (len + BS - 1) / BS;
  for (int64_t j0 = 0; j0 < nb; j0 += span) {
    const int64_t j1 = std::min(nb, j0 + span);
    const int64_t total = std::min(len, j1 * BS) - j0 * BS;  // every block of the span is full but the last
    for (int64_t j = j0; j < j1; ++j)
      block_scores<scalar_t, GC>(q, kc + (table[j] * KVH + kh) * HD * BS, std::min(BS, len - j * BS), BS, HD,
                                 s + (j - j0) * BS, ss);
    for (int c = 0; c < GC; ++c) {  // what came before rescaled to the new max
      float* sc = s + c * ss;
      const int64_t full = total / W * W;
      vf mv = splat(m[c]);
      for (int64_t i = 0; i < full; i += W) {
        const vf v = load_lanes(sc + i);
        mv = v > mv ? v : mv;
      }
      float mb = lane_max(mv);
      for (int64_t i = full; i < total; ++i) mb = std::max(mb, sc[i]);
      const float alpha = std::exp(m[c] - mb);  // 0 on the first span (m = -inf), where acc is 0
      vf sv = vf{};
      for (int64_t i = 0; i < full; i += W) {
        const vf e = exp_nonpositive(load_lanes(sc + i) - mb);
        store(sc + i, e);
        sv += e;
      }
      float sum = lane_sum(sv);
      for (int64_t i = full; i < total; ++i) {
        sc[i] = std::exp(sc[i] - mb);
        sum += sc[i];
      }
      l[c] = l[c] * alpha + sum;
      m[c] = mb;
      for (int64_t x = 0; x < HD; ++x) acc[c * HD + x] *= alpha;
    }
    for (int64_t j = j0; j < j1; ++j)
      block_values<scalar_t, GC>(s + (j - j0) * BS, ss, vc + (table[j] * KVH + kh) * BS * HD,
                                 std::min(BS, len - j * BS), HD, acc);
  }
}

// out[d, kh*G + g] = softmax(scale * q[d, kh*G + g] . K[d, kh]^T) V[d, kh] over positions [0, lens[d]), where
// position p of sequence d is row p % BS of block tables[d, p / BS]. One task per (sequence, kv head); its G query
// heads are taken up to four at a time, so each tile is read once for them (G = 3 for SmolLM2, 4 or 8 for Llama).
template <typename scalar_t>
void decode_impl(const scalar_t* q, const scalar_t* kc, const scalar_t* vc, const int32_t* tables,
                 const int32_t* lens, scalar_t* out, int64_t D, int64_t H, int64_t KVH, int64_t BS, int64_t HD,
                 int64_t MAXB, float scale) {
  const int64_t G = H / KVH;
  const int64_t ss = std::max<int64_t>(1, SPAN / BS) * BS;
  using Attend = void (*)(const float*, const scalar_t*, const scalar_t*, const int32_t*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float*, float*, float*, float*);
  const Attend by_count[4] = {attend_blocks<scalar_t, 1>, attend_blocks<scalar_t, 2>, attend_blocks<scalar_t, 3>,
                              attend_blocks<scalar_t, 4>};  // query heads per pass
  at::parallel_for(0, D * KVH, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> qf(G * HD), acc(G * HD), s(4 * ss), m(G), l(G);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t d = task / KVH, kh = task % KVH;
      const scalar_t* qd = q + (d * H + kh * G) * HD;  // this group's G query heads are adjacent
      for (int64_t i = 0; i < G * HD; ++i) qf[i] = static_cast<float>(qd[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t g = 0; g < G; g += 4) {
        const float* qg = qf.data() + g * HD;
        float* ag = acc.data() + g * HD;
        const int32_t* table = tables + d * MAXB;
        by_count[std::min<int64_t>(4, G - g) - 1](qg, kc, vc, table, lens[d], kh, KVH, BS, HD, s.data(), ag, &m[g],
                                                  &l[g]);
      }
      scalar_t* od = out + (d * H + kh * G) * HD;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t x = 0; x < HD; ++x) od[g * HD + x] = static_cast<scalar_t>(acc[g * HD + x] / l[g]);
    }
  });
}

// q (D, H, HD); kc (NB, KVH, HD, BS); vc (NB, KVH, BS, HD); tables (D, MAXB) int32; lens (D,), in [1, MAXB * BS].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && vc.dim() == 4, "paged_decode: bad shapes");
  TORCH_CHECK(kc.size(0) == vc.size(0) && kc.size(1) == vc.size(1) && kc.size(2) == vc.size(3) &&
              kc.size(3) == vc.size(2), "paged_decode: keys (NB, KVH, HD, BS) and values (NB, KVH, BS, HD) differ");
  TORCH_CHECK(q.size(2) == vc.size(3) && q.size(1) % vc.size(1) == 0, "paged_decode: heads or head_dim differ");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && lens.size(0) == q.size(0),
              "paged_decode: one block table and length per query");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(),
              "paged_decode: q, keys and values must share a dtype");
  TORCH_CHECK(tables.scalar_type() == at::kInt && lens.scalar_type() == at::kInt, "paged_decode: int32 indices");
  TORCH_CHECK(q.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && tables.is_contiguous() &&
              lens.is_contiguous(), "paged_decode: not contiguous");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                          tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<scalar_t>(),
                          q.size(0), q.size(1), vc.size(1), vc.size(2), vc.size(3), tables.size(1),
                          static_cast<float>(scale));
  });
  return out;
}
"""

_KERNEL = InlineKernel("shardmesh_paged", _SOURCE, ["paged_decode"], ["-O3", "-march=native", "-ffp-contract=fast"])


def available() -> bool:
    """Whether the kernel is built (building it now if it is not cached)."""
    return _KERNEL.module() is not None


def build_error() -> str:
    """Why the kernel could not be built ("" when it was, or was not tried)."""
    return _KERNEL.build_error


class DecodeKernel(Protocol):
    """One new query per sequence against its blocks: q (D, h, hd); keys (num_blocks, kvh, hd, bs) and values
    (num_blocks, kvh, bs, hd) of one layer (`PagedKVCache.keys`, `values`); tables (D, max_blocks) int32, padded
    past each sequence's blocks with any valid id; lengths (D,) int32, the positions each query sees (>= 1)
    → (D, h, hd). Query heads kh*g .. kh*g + g - 1 share kv head kh."""

    name: str

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor: ...


def gather_blocks(keys: Tensor, values: Tensor, blocks: Tensor) -> tuple[Tensor, Tensor]:
    """The positions in `blocks` (any leading shape, say (..., n)) put together: keys and values each
    (..., kvh, n * bs, hd). A copy."""
    k, v = keys[blocks], values[blocks]  # (..., n, kvh, hd, bs), (..., n, kvh, bs, hd)
    lead, (n, kvh, hd, bs) = k.shape[:-4], k.shape[-4:]
    k = k.movedim(-4, -3).transpose(-1, -2)  # (..., kvh, n, bs, hd)
    v = v.movedim(-4, -3)
    return k.reshape(*lead, kvh, n * bs, hd), v.reshape(*lead, kvh, n * bs, hd)


class CpuDecode:
    """The compiled kernel: reads each block where it lies."""

    name = "paged-cpu"

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
        ext = _KERNEL.module()
        assert ext is not None, build_error()
        return ext.paged_decode(q.contiguous(), keys, values, tables, lengths, 1 / math.sqrt(q.shape[-1]))


class GatherDecode:
    """The blocks of every sequence gathered into (D, kvh, max_blocks * bs, hd), then one masked SDPA call:
    copies each sequence's history per layer, but runs wherever torch does."""

    name = "paged-gather"

    def __call__(self, q: Tensor, keys: Tensor, values: Tensor, tables: Tensor, lengths: Tensor) -> Tensor:
        D, h, hd = q.shape
        kvh = keys.shape[1]
        k, v = gather_blocks(keys, values, tables.long())  # (D, kvh, max_blocks * bs, hd)
        seen = torch.arange(k.shape[2], device=q.device)[None, :] < lengths[:, None].to(q.device)
        o = F.scaled_dot_product_attention(q.view(D, kvh, h // kvh, hd), k, v, attn_mask=seen[:, None, None, :])
        return o.reshape(D, h, hd)


def choose(device: torch.device | str) -> DecodeKernel:
    """The compiled kernel on a CPU where it builds; the gather otherwise (another device, or no compiler)."""
    if torch.device(device).type == "cpu" and available():
        return CpuDecode()
    return GatherDecode()
