"""The int8 product on a GPU: Y = X (Q · s + m)ᵀ, the weight dequantized inside a Triton kernel as it is read.

Why a kernel: a decode step multiplies a few rows by every weight, so it takes as long as reading the weights. The
plain way (`linear.Int8DequantKernel`: dequantize the whole weight, then a float product) reads the int8 weight,
writes it out in float and reads that back: more bytes than the float weight it replaces. This kernel reads each
int8 value and each group's (scale, minimum) pair once, widens them in registers, rounds the weight to the
activations' dtype (as `Int8DequantKernel` does, so both compute the same numbers up to the order of sums) and
multiplies on the tensor cores, accumulating in float32: 1.125 bytes a weight against bfloat16's 2.

Layout (`linear.quantize_groups`): values q (N, K) int8 row-major, pairs (N, ⌈K/G⌉, 2) float16, W[n, k] =
(q[n, k] + 128) · s[n, k // G] + m[n, k // G], G = `INT8_GROUP`. A program computes BLOCK_N outputs of up to
BLOCK_M rows; K is walked BLOCK_K at a time (a multiple of G, so a tile's groups are whole but for the last).

Up to `MAX_ROWS` rows (decode); more (a prompt) take `Int8DequantKernel`'s float product, compute-bound there.
Triton is imported on first use: it ships with CUDA builds of PyTorch, not with the CPU wheel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from shardmesh.core.dtypes import INT8_GROUP

MAX_ROWS = 16
BLOCK_M = 16  # tl.dot's smallest tile; decode rows are padded up to it by masking
BLOCK_K = 256


def available() -> bool:
    """Whether the kernel can run here: a CUDA device and Triton."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def int8_linear(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, G, stride_x, stride_q, stride_s, stride_y,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                    IEEE: tl.constexpr):  # fmt: skip
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0.0)  # fmt: skip
            q = tl.load(q_ptr + rn[:, None] * stride_q + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                        other=-128)  # fmt: skip
            rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            pair = s_ptr + rn[:, None] * stride_s + rg[None, :] * 2
            gmask = (rn[:, None] < N) & (rg[None, :] < G)
            s = tl.load(pair, mask=gmask, other=0.0).to(tl.float32)
            m = tl.load(pair + 1, mask=gmask, other=0.0).to(tl.float32)
            w = tl.reshape(q.to(tl.float32) + 128.0, (BLOCK_N, BLOCK_K // GROUP, GROUP))
            w = tl.reshape(w * s[:, :, None] + m[:, :, None], (BLOCK_N, BLOCK_K))
            w = w.to(x.dtype)  # the weight in the activations' dtype, as Int8DequantKernel rounds it
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))

    return int8_linear


def linear(x: Tensor, q: Tensor, pairs: Tensor) -> Tensor:
    """x (M, K) times the int8 weight (q (N, K), pairs (N, groups, 2)), M ≤ `MAX_ROWS`: (M, N) in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    if q.stride(1) != 1 or pairs.stride()[1:] != (2, 1):
        raise ValueError("int8_cuda.linear reads int8 rows and (scale, minimum) pairs laid out along them")
    x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    # Enough programs to keep every multiprocessor reading: 32 outputs each on the narrow products (4,096 outputs:
    # 128 programs), 64 on the wide ones.
    block_n = 32 if n <= 8192 else 64
    grid = (-(-n // block_n), -(-m // BLOCK_M))
    _kernel()[grid](x, q, pairs, y, m, n, k, pairs.shape[1], x.stride(0), q.stride(0), pairs.stride(0), y.stride(0),
                    BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, GROUP=INT8_GROUP,
                    IEEE=x.dtype == torch.float32, num_warps=4)  # fmt: skip
    return y
