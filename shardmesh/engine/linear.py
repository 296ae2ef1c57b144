"""The matrix products of a shard, Y = X Wᵀ + b, and the kernels that compute them.

Every product module (`Linear` here, the tensor-parallel ones in `tp.py`) is a `LinearProduct`: it holds
its weight the way its `kernel` reads it and its forward calls that kernel, nothing else. The loader
picks one kernel per shard from the dtype, the device and what the CPU offers (`choose_kernel`) and
re-stores each weight for it once (`LinearProduct.use_kernel`). A new way to multiply (int8, offload)
is a new `LinearKernel` class and a line in `choose_kernel`.

On a CPU with AVX-512, float32 and bfloat16 shards take `BlockedCpuKernel`, int8 ones `BlockedInt8Kernel`
(`shardmesh.engine.cpu_kernels`: weights in blocks of output features, a loop compiled for the CPU; float32 one row
16.6 against oneDNN's 22.8 ms, bfloat16 7.5-10 against 20-22 ms), which the compiled decode path (`cpu_decode`) also
reads. Elsewhere, PyTorch's products and the int8 kernels below.

Why the CPU kernels: a decode step is a few rows times every weight matrix, memory-bound matrix-vector
work. On a 2-core machine PyTorch's default GEMM for such shapes streams weights at ~16-20 GB/s and does
not use the second core for one row, while oneDNN's inner product on weights pre-packed into its
blocked layout does (measured, fp32, 60 distinct 576x1536 matrices, 2 threads: 9.9 vs 12.7 ms for one
row, 13.4 vs 27.5 ms for 16 rows; the whole SmolLM2 step in process: 42 -> 31 ms for one sequence, 108
-> 67 ms for 16). oneDNN packs float32 only; other CPU dtypes get the input-major layout, which is
PyTorch's faster GEMM for few rows (SmolLM2, all weights, one token: 41 -> 28 ms, see bench/).

int8 weights (`Quantization.INT8`: int8 values, one float32 scale per output row) keep the activations in
float, so every tensor-parallel degree computes the same numbers. On a float32 CPU shard: a loop compiled for
the CPU at first use (`Int8CpuKernel`, `shardmesh.engine.int8_cpu`: all SmolLM2 products, one row, about a
third of float32's time), else `torch._weight_int8pack_mm` with float32 activations (`Int8FP32Kernel`, slower
than float32: 58 against 22 ms); elsewhere each weight converted to the activations' dtype inside the product
(`Int8DequantKernel`). `Int8BF16Kernel` (`_weight_int8pack_mm` with bfloat16 activations, 10.5 ms on a CPU with
native bfloat16) rounds each row-parallel partial sum to bfloat16 before the all-reduce adds them, so tp=3 and
tp=1 differ (a greedy token flipped at a near-tie on SmolLM2): it is not chosen, only named.
`SHARDMESH_LINEAR_KERNEL` names a kernel to use instead of the one chosen.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.engine import cpu_kernels, int8_cpu
from shardmesh.engine.cpu_features import cpu_flags

# The batch size oneDNN chooses the packed layout for. Not 1, though decode multiplies one row per sequence:
# the layout picked for 16 rows streams weights faster at every batch size measured (SmolLM2, all 121
# products, fp32, 2 threads: 1 row 16.0 -> 10.5 ms, 16 rows 33.4 -> 22.7 ms, 64 rows 86 -> 66 ms; the
# whole in-process step, 1 sequence: 23.8 -> 16.4 ms, 16 sequences: 60.9 -> 48.7 ms; 1 thread, layers
# 0-15: 13.3 -> 9.9 ms). 8 was in between, 32 and 64 the same as 16.
PACK_ROWS = 16


class LinearKernel(ABC):
    """One way to compute Y = X Wᵀ + b, W being (out, in) as checkpoints store it.

    `prepare` re-stores a loaded weight, once, in the layout this kernel reads (same values), and
    `prepare_scale` its scale (quantized kernels); `__call__` multiplies by a prepared weight; `dense` gives a
    prepared weight's (out, in) values back. `name` is what logs and `status` call it.
    """

    name = "dense"
    quantized = False  # reads int8 weights with a scale per output row

    def prepare(self, weight: Tensor) -> Tensor:
        return weight

    def prepare_scale(self, scale: Tensor) -> Tensor:
        return scale

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        return weight

    @abstractmethod
    def __call__(
        self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None
    ) -> Tensor: ...


class DenseKernel(LinearKernel):
    """`F.linear` on the weight as loaded: CUDA, and every product before the loader chooses a kernel."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        return F.linear(x, weight, bias)


class InputMajorKernel(DenseKernel):
    """`F.linear` on W re-stored as the transpose of a contiguous (in, out) array: same shape and values,
    only the memory order changes, so `W.t()` in `F.linear`'s `x @ W.t()` is contiguous (CPU, not float32)."""

    name = "input-major"

    def prepare(self, weight: Tensor) -> Tensor:
        return weight.t().contiguous().t()


class OneDNNPackedKernel(LinearKernel):
    """oneDNN's inner product on W packed into its blocked layout for `PACK_ROWS` rows (CPU, float32)."""

    name = "onednn-packed"

    def prepare(self, weight: Tensor) -> Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        return weight.to_dense()  # a copy

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class BlockedCpuKernel(LinearKernel):
    """`cpu_kernels.linear`: weights in blocks of output features, multiplied by a loop compiled for this CPU (float32,
    or bfloat16 through AVX512-BF16 where the CPU has it); the layout and the measurements are in `cpu_kernels`. The
    decode runner (`cpu_decode`) reads these weights too (CPU, float32 and bfloat16, where the kernels build)."""

    name = "cpu-blocked"

    def prepare(self, weight: Tensor) -> Tensor:
        return cpu_kernels.pack(weight)

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        return cpu_kernels.unpack(weight)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        return cpu_kernels.linear(x, weight, bias, scale)


class BlockedInt8Kernel(BlockedCpuKernel):
    """The same blocks of int8 weights, widened to float32 in registers, with float32 activations and sums and the
    scale applied to each sum: the numbers of `Int8DequantKernel`, a quarter of float32's bytes (CPU, float32
    activations, AVX-512, kernels built; the decode runner reads these too)."""

    name = "int8-blocked"
    quantized = True

    def prepare_scale(self, scale: Tensor) -> Tensor:
        return scale.float().contiguous()

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        return super().dense(weight).float() * scale.float()[:, None]


class Int8DequantKernel(LinearKernel):
    """Y = (X Qᵀ) · s + b, Q converted to X's dtype inside the product: activations stay as they are, so every
    tensor-parallel degree computes the same numbers as a float product of the dequantized weight (CUDA, and
    CPUs without native bfloat16)."""

    name = "int8-dequant"
    quantized = True

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        return weight.float() * scale.float()[:, None]

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        y = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
        return y + bias if bias is not None else y


class _Int8RowsKernel(Int8DequantKernel):
    """An int8 product over X's rows as one (rows, in) matrix, `_rows`, for up to `max_rows` rows (None: any);
    more take `Int8DequantKernel`'s float GEMM."""

    max_rows: int | None = None

    @abstractmethod
    def _rows(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor: ...

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        rows = x.reshape(-1, x.shape[-1])
        if self.max_rows is not None and rows.shape[0] > self.max_rows:
            return super().__call__(x, weight, bias, scale)
        y = self._rows(rows, weight, scale).reshape(*x.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y


class Int8FP32Kernel(_Int8RowsKernel):
    """`torch._weight_int8pack_mm` with float32 activations and scales for one row, float32 in and out; more rows
    take `Int8DequantKernel`'s product, whose cost hardly grows with them while this op's grows with each row
    (all SmolLM2 products: 58 ms for 1 row, 1.4 s for 16, against 100 and ~110 ms) (CPU, float32)."""

    name = "int8-fp32"
    max_rows = 1

    def _rows(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(rows, weight, scale)


class Int8CpuKernel(_Int8RowsKernel):
    """`int8_cpu.linear` for up to `int8_cpu.MAX_ROWS` rows (decode), `Int8DequantKernel`'s float GEMM for more
    (a prompt), float32 in and out (CPU, float32, where the kernel builds)."""

    name = "int8-cpu"
    max_rows = int8_cpu.MAX_ROWS

    def _rows(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        return int8_cpu.linear(rows, weight, scale)


class Int8BF16Kernel(_Int8RowsKernel):
    """`torch._weight_int8pack_mm`: X in bfloat16 times int8 Q, float32 accumulation, times s, rounded to
    bfloat16 (CPUs with native bfloat16). Weight-only: the activations are rounded to bfloat16 on the way in
    and the product on the way out, elementwise, the same at every tensor-parallel degree except the partial
    sums of row-parallel products, each rounded before they are added."""

    name = "int8-bf16"

    def prepare_scale(self, scale: Tensor) -> Tensor:
        return scale.to(torch.bfloat16)

    def _rows(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(rows.to(torch.bfloat16), weight, scale).to(rows.dtype)


DENSE = DenseKernel()
KERNELS: dict[str, type[LinearKernel]] = {
    k.name: k
    for k in (
        DenseKernel,
        InputMajorKernel,
        OneDNNPackedKernel,
        BlockedCpuKernel,
        Int8DequantKernel,
        Int8FP32Kernel,
        Int8CpuKernel,
        BlockedInt8Kernel,
        Int8BF16Kernel,
    )
}
KERNEL_ENV = "SHARDMESH_LINEAR_KERNEL"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _blocked_suits_cpu() -> bool:
    """Whether the blocked kernels are the ones to take: measured where AVX-512 holds a block's sums in registers
    (elsewhere PyTorch's products and `int8_cpu`), and built."""
    return "avx512f" in cpu_flags() and cpu_kernels.available()


def choose_kernel(dtype: torch.dtype, device: torch.device | str, quantized: bool = False) -> LinearKernel:
    """The kernel for the products of a shard in `dtype` on `device`, int8 ones when `quantized` (the module
    docstring says why); `SHARDMESH_LINEAR_KERNEL` overrides, if it reads the same weights."""
    override = os.environ.get(KERNEL_ENV)
    if override:
        if override not in KERNELS:
            raise ValueError(f"{KERNEL_ENV}={override!r}: expected one of {', '.join(KERNELS)}")
        kernel = KERNELS[override]()
        if kernel.quantized == quantized:
            return kernel
    cpu = torch.device(device).type == "cpu"
    if quantized:
        if not (cpu and dtype == torch.float32):
            return Int8DequantKernel()
        if _blocked_suits_cpu():
            return BlockedInt8Kernel()
        return Int8CpuKernel() if int8_cpu.available() else Int8FP32Kernel()
    if not cpu:
        return DENSE
    if dtype in (torch.float32, torch.bfloat16) and _blocked_suits_cpu():
        return BlockedCpuKernel()
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return OneDNNPackedKernel()
    return InputMajorKernel()


class LinearProduct(nn.Module):
    """A module whose product with `weight` is computed by `kernel`, `DENSE` until the loader picks one.

    A quantized product's `weight` holds int8 values and `weight_scale` one float32 scale per output row
    (None for a float product): W = weight · weight_scale, row by row.
    """

    weight: nn.Parameter
    weight_scale: Tensor | None
    kernel: LinearKernel = DENSE

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_scale", None)

    def use_kernel(self, kernel: LinearKernel) -> None:
        """Re-store `weight` for `kernel` and multiply with it from now on; the original is freed as its
        replacement is assigned, so a model re-stored module by module holds one extra matrix at most."""
        if kernel.quantized != (self.weight_scale is not None):
            raise ValueError(f"kernel {kernel.name} does not read {self.weight.dtype} weights")
        self.weight = nn.Parameter(kernel.prepare(self.weight.detach()), requires_grad=False)
        if self.weight_scale is not None:
            self.weight_scale = kernel.prepare_scale(self.weight_scale)
        self.kernel = kernel

    def product(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        return self.kernel(x, self.weight, bias, self.weight_scale)


def layer_products(model: nn.Module) -> set[str]:
    """The weights of the decoder layers' products (`model.layers.<i>....weight`): what `Quantization.INT8` holds
    as int8 and what a memory budget streams. Not the LM head (kept in the serving dtype: int8 there raised
    SmolLM2's logprob error by a third) nor the embedding (a lookup)."""
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, LinearProduct) and name.startswith("model.layers.")
    }


def quantize_rows(weight: Tensor, row_absmax: Tensor) -> tuple[Tensor, Tensor]:
    """(float32 scales (out,), int8 values (out, in)) with weight ≈ values · scale row by row; an all-zero row
    gets the smallest scale (its values are 0 whatever it is)."""
    scale = (row_absmax.float() / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(weight.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return scale, q


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
        return self.product(x, self.bias)
