"""The matrix products of a shard, Y = X Wᵀ + b, and the kernels that compute them.

Every product module (`Linear` here, the tensor-parallel ones in `tp.py`) is a `LinearProduct`: it holds
its weight the way its `kernel` reads it and its forward calls that kernel, nothing else. The loader
picks one kernel per shard from the dtype, the device and what the CPU offers (`choose_kernel`) and
re-stores each weight for it once (`LinearProduct.use_kernel`). A new way to multiply (int8, offload)
is a new `LinearKernel` class and a line in `choose_kernel`.

Why the CPU kernels: a decode step is a few rows times every weight matrix, memory-bound matrix-vector
work. On a 2-core machine PyTorch's default GEMM for such shapes streams weights at ~16-20 GB/s and does
not use the second core for one row, while oneDNN's inner product on weights pre-packed into its
blocked layout does (measured, fp32, 60 distinct 576x1536 matrices, 2 threads: 9.9 vs 12.7 ms for one
row, 13.4 vs 27.5 ms for 16 rows; the whole SmolLM2 step in process: 42 -> 31 ms for one sequence, 108
-> 67 ms for 16). oneDNN packs float32 only; other CPU dtypes get the input-major layout, which is
PyTorch's faster GEMM for few rows (SmolLM2, all weights, one token: 41 -> 28 ms, see bench/).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The batch size oneDNN chooses the packed layout for. Not 1, though decode multiplies one row per sequence:
# the layout picked for 16 rows streams weights faster at every batch size measured (SmolLM2, all 121
# products, fp32, 2 threads: 1 row 16.0 -> 10.5 ms, 16 rows 33.4 -> 22.7 ms, 64 rows 86 -> 66 ms; the
# whole in-process step, 1 sequence: 23.8 -> 16.4 ms, 16 sequences: 60.9 -> 48.7 ms; 1 thread, layers
# 0-15: 13.3 -> 9.9 ms). 8 was in between, 32 and 64 the same as 16.
PACK_ROWS = 16


class LinearKernel(ABC):
    """One way to compute Y = X Wᵀ + b, W being (out, in) as checkpoints store it.

    `prepare` re-stores a loaded weight, once, in the layout this kernel reads (same values); `__call__`
    multiplies by a prepared weight; `dense` gives a prepared weight's (out, in) values back.
    """

    def prepare(self, weight: Tensor) -> Tensor:
        return weight

    def dense(self, weight: Tensor) -> Tensor:
        return weight

    @abstractmethod
    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor: ...


class DenseKernel(LinearKernel):
    """`F.linear` on the weight as loaded: CUDA, and every product before the loader chooses a kernel."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)


class InputMajorKernel(DenseKernel):
    """`F.linear` on W re-stored as the transpose of a contiguous (in, out) array: same shape and values,
    only the memory order changes, so `W.t()` in `F.linear`'s `x @ W.t()` is contiguous (CPU, not float32)."""

    def prepare(self, weight: Tensor) -> Tensor:
        return weight.t().contiguous().t()


class OneDNNPackedKernel(LinearKernel):
    """oneDNN's inner product on W packed into its blocked layout for `PACK_ROWS` rows (CPU, float32)."""

    def prepare(self, weight: Tensor) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)

    def dense(self, weight: Tensor) -> Tensor:
        return weight.to_dense()  # a copy

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


DENSE = DenseKernel()


def choose_kernel(dtype: torch.dtype, device: torch.device | str) -> LinearKernel:
    """The kernel for every product of a shard in `dtype` on `device` (the module docstring says why)."""
    if torch.device(device).type != "cpu":
        return DENSE
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return OneDNNPackedKernel()
    return InputMajorKernel()


class LinearProduct(nn.Module):
    """A module whose product with `weight` is computed by `kernel`, `DENSE` until the loader picks one."""

    weight: nn.Parameter
    kernel: LinearKernel = DENSE

    def use_kernel(self, kernel: LinearKernel) -> None:
        """Re-store `weight` for `kernel` and multiply with it from now on; the original is freed as its
        replacement is assigned, so a model re-stored module by module holds one extra matrix at most."""
        self.weight = nn.Parameter(kernel.prepare(self.weight.detach()), requires_grad=False)
        self.kernel = kernel


@dataclass(frozen=True)
class Block:
    """Rows of a stacked product that checkpoints store as a tensor of their own: `rows` output features,
    from the module `name` beside the stacked one (`q_proj` for the first rows of `qkv_proj`)."""

    name: str
    rows: int


class Linear(LinearProduct, nn.Linear):
    """Y = X Wᵀ + b, with W (out, in). With `blocks`, several products that read the same input stacked by
    output rows, W = [W_0; W_1; ...]: one larger product instead of several, filled block by block."""

    def __init__(self, in_features: int, out_features: int, bias: bool, blocks: tuple[Block, ...] = ()) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if blocks and sum(b.rows for b in blocks) != out_features:
            raise ValueError(f"blocks {blocks} do not add up to {out_features} output features")
        self.blocks = blocks

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel(x, self.weight, self.bias)
