"""The matrix products of a shard, Y = X Wᵀ + b, and the kernels that compute them.

Every product module (`Linear` here, the tensor-parallel ones in `tp.py`) is a `LinearProduct`: it holds
its weight the way its `kernel` reads it and its forward calls that kernel, nothing else. The loader
picks one kernel per shard from the dtype, the device and what the CPU offers (`choose_kernel`) and
re-stores each weight for it once (`LinearProduct.use_kernel`). A new way to multiply (int8, offload)
is a new `LinearKernel` class and a line in `choose_kernel`.

On a CPU with AVX-512, or AVX2 with FMA and F16C, float32 and bfloat16 shards take `BlockedCpuKernel`, int8 ones
`BlockedInt8Kernel` (`shardmesh.engine.cpu_kernels`: weights in blocks of output features, a loop compiled for the
CPU; on a Zen 4, float32 one row 16.6 against oneDNN's 22.8 ms, bfloat16 7.5-10 against 20-22 ms), which the compiled
decode path (`cpu_decode`) also reads. Without them (a CPU older than 2013, or no compiler), PyTorch's products and
the int8 kernels below: on an AVX2 CPU without native bfloat16 those took a SmolLM2 decode step of one sequence 1.8x
as long in float32 and 19.5x in bfloat16 (bench/cpu_paths.py; docs/performance.md, "AVX2 hosts").

Why the CPU kernels: a decode step is a few rows times every weight matrix, memory-bound matrix-vector
work. On a 2-core machine PyTorch's default GEMM for such shapes streams weights at ~16-20 GB/s and does
not use the second core for one row, while oneDNN's inner product on weights pre-packed into its
blocked layout does (measured, fp32, 60 distinct 576x1536 matrices, 2 threads: 9.9 vs 12.7 ms for one
row, 13.4 vs 27.5 ms for 16 rows; the whole SmolLM2 step in process: 42 -> 31 ms for one sequence, 108
-> 67 ms for 16). oneDNN packs float32 only; other CPU dtypes get the input-major layout, which is
PyTorch's faster GEMM for few rows (SmolLM2, all weights, one token: 41 -> 28 ms, see bench/).

int8 weights (`Quantization.INT8`, `quantize_groups`): int8 values with a float16 scale and minimum per `INT8_GROUP`
input features of each output row, W[n, k] = (q[n, k] + 128) · s[n, k // G] + m[n, k // G], 1.125 bytes per weight.
Each group takes whichever of two grids holds it more closely: symmetric (steps of max|w| / 127 around 0, llama.cpp's
Q8_0) or asymmetric (255 steps from its minimum to its maximum, Q4_1's shape at 8 bits). A checkpoint whose weights
were once quantized to a 4- or 8-bit grid in blocks of 32 (SmolLM2's GGUF: Q4_1 layers, a Q8_0 embedding) is held
exactly, up to the scale's float16 rounding; one scale per output row, the first format, lost 0.051 nats per token on
SmolLM2 (bench/int8_quality.py). The activations stay in float, so every tensor-parallel degree computes the same
numbers. On a float32 CPU shard with AVX-512 or AVX2 the blocked loop (`BlockedInt8Kernel`); other CPUs a loop
compiled for them (`Int8CpuKernel`, `shardmesh.engine.int8_cpu`); on CUDA a Triton kernel that dequantizes as it reads
(`Int8CudaKernel`, `shardmesh.engine.int8_cuda`); without a compiler or Triton, or in other CPU dtypes, each weight
converted to the activations' dtype inside the product (`Int8DequantKernel`). PyTorch's own int8 product
(`_weight_int8pack_mm`) takes one scale per row, so none of them uses it.
`SHARDMESH_LINEAR_KERNEL` names a kernel to use instead of the one chosen.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.dtypes import INT8_GROUP, INT8_QUANTIZE_CHUNK
from shardmesh.engine import cpu_kernels, int8_cpu, int8_cuda
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
    quantized = False  # reads int8 weights with their groups' scales (`quantize_groups`)

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
    or bfloat16 on AMX tiles or through AVX512-BF16 where the CPU has them; products of several rows through vdpbf16ps
    or FMAs on widened weights, whichever this core runs faster, chosen as the first bfloat16 weight is prepared:
    `cpu_kernels.choose_bf16_rows`); the layout and the measurements are in `cpu_kernels`. The decode runner
    (`cpu_decode`) reads these weights too (CPU, float32 and bfloat16, where the kernels build)."""

    name = "cpu-blocked"

    def prepare(self, weight: Tensor) -> Tensor:
        if weight.dtype == torch.bfloat16:
            cpu_kernels.choose_bf16_rows()  # once: vdpbf16ps or widened for several rows, the faster on this core
        return cpu_kernels.pack(weight)

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        return cpu_kernels.unpack(weight)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        return cpu_kernels.linear(x, weight, bias, scale)


class BlockedInt8Kernel(BlockedCpuKernel):
    """The same blocks of int8 weights, widened to float32 in registers, with float32 activations: each group's sums
    scaled, plus its offset times the group's sum of inputs (`cpu_kernels.pack_groups` lays the scales out by block).
    The numbers of `Int8DequantKernel` up to the order of sums, at a bit over a quarter of float32's bytes (CPU,
    float32 activations, AVX-512, kernels built; the decode runner reads these too)."""

    name = "int8-blocked"
    quantized = True

    def prepare_scale(self, scale: Tensor) -> Tensor:
        return cpu_kernels.pack_groups(scale)

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        return dequantize(super().dense(weight), cpu_kernels.unpack_groups(scale))


class Int8DequantKernel(LinearKernel):
    """Y = X (Q · s + o)ᵀ + b, the weight dequantized to X's dtype inside the product: activations stay as they are,
    so every tensor-parallel degree computes the same numbers as a float product of the dequantized weight (CUDA
    without Triton, CPU dtypes other than float32, CPUs without a compiler)."""

    name = "int8-dequant"
    quantized = True

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        return dequantize(weight, scale)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        return F.linear(x, dequantize(weight, scale).to(x.dtype), bias)


class Int8DecodeKernel(Int8DequantKernel):
    """A kernel of its own (`rows_linear`) for up to `max_rows` rows (decode), `Int8DequantKernel`'s float product for
    more (a prompt, where the product is compute-bound)."""

    max_rows = 0

    def rows_linear(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        assert scale is not None
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > self.max_rows:
            return super().__call__(x, weight, bias, scale)
        y = self.rows_linear(rows, weight, scale).reshape(*x.shape[:-1], weight.shape[0])
        return y + bias if bias is not None else y


class Int8CpuKernel(Int8DecodeKernel):
    """`int8_cpu.linear` on decode rows, float32 in and out (CPU, float32, where the kernel builds)."""

    name = "int8-cpu"
    max_rows = int8_cpu.MAX_ROWS

    def rows_linear(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        return int8_cpu.linear(rows, weight, scale)


class Int8CudaKernel(Int8DecodeKernel):
    """`int8_cuda.linear` on decode rows, a Triton kernel that dequantizes as it reads (CUDA, where Triton is)."""

    name = "int8-triton"
    max_rows = int8_cuda.MAX_ROWS

    def rows_linear(self, rows: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
        return int8_cuda.linear(rows, weight, scale)


def row_major_int8(device: torch.device | str, dtype: torch.dtype) -> Int8DequantKernel:
    """The int8 kernel for weights as `quantize_groups` lays them out (row-major, not re-stored for a kernel) times
    activations in `dtype` on `device`: a compiled loop on CPU float32, Triton on CUDA, else the weight dequantized in
    the product."""
    kind = torch.device(device).type
    if kind == "cpu" and dtype == torch.float32 and int8_cpu.available():
        return Int8CpuKernel()
    if kind == "cuda" and int8_cuda.available():
        return Int8CudaKernel()
    return Int8DequantKernel()


DENSE = DenseKernel()
KERNELS: dict[str, type[LinearKernel]] = {
    k.name: k
    for k in (
        DenseKernel,
        InputMajorKernel,
        OneDNNPackedKernel,
        BlockedCpuKernel,
        Int8DequantKernel,
        Int8CpuKernel,
        BlockedInt8Kernel,
        Int8CudaKernel,
    )
}
KERNEL_ENV = "SHARDMESH_LINEAR_KERNEL"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _blocked_suits_cpu() -> bool:
    """Whether the blocked kernels are the ones to take: where AVX-512, or AVX2 with FMA and F16C, holds a block's
    sums in registers (elsewhere PyTorch's products and `int8_cpu`), and built."""
    flags = cpu_flags()
    return ("avx512f" in flags or {"avx2", "fma", "f16c"} <= flags) and cpu_kernels.available()


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
        if cpu and dtype == torch.float32 and _blocked_suits_cpu():
            return BlockedInt8Kernel()
        return row_major_int8(device, dtype)
    if not cpu:
        return DENSE
    if dtype in (torch.float32, torch.bfloat16) and _blocked_suits_cpu():
        return BlockedCpuKernel()
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        return OneDNNPackedKernel()
    return InputMajorKernel()


class LinearProduct(nn.Module):
    """A module whose product with `weight` is computed by `kernel`, `DENSE` until the loader picks one.

    A quantized product's `weight` holds int8 values and `weight_scale` (out, groups, 2) float16 pairs, the scale
    and minimum of each group of `INT8_GROUP` inputs (None for a float product): `dequantize` says how they
    combine. Kernels may re-store both (`LinearKernel.prepare`, `prepare_scale`).
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
    """The weights of the decoder layers' products (`model.layers.<i>....weight`): what a memory budget streams.
    Not the LM head nor the embedding (a lookup)."""
    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, LinearProduct) and name.startswith("model.layers.")
    }


def int8_products(model: nn.Module) -> set[str]:
    """What `Quantization.INT8` holds as int8: the decoder layers' products and the LM head (`vocab × hidden`: as many
    bytes as all of SmolLM2's int8 layers were it float32, read every decode step). The embedding is a lookup and
    stays in the serving dtype, as do the norms; a tied head is quantized from the embedding's matrix, which the
    embedding keeps."""
    head = {"lm_head.weight"} if getattr(model, "lm_head", None) is not None else set()
    return layer_products(model) | head


ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what `cpu_kernels.quantize_groups` reads


def quantize_groups(weight: Tensor, group: int = INT8_GROUP) -> tuple[Tensor, Tensor]:
    """(int8 values q (out, in), float16 (out, groups, 2) scale s and minimum m of each `group` inputs of a row) with
    weight ≈ s · (q + 128) + m, group by group (the last one may be shorter): 4 bytes per group, an eighth of a byte
    per weight at 32.

    Each group takes the closer (least squared error) of two grids: symmetric, s = max|w| / 127 and m = −128 s
    (values ±127 around 0), or asymmetric, s = (max − min) / 255 and m = min (256 values from the minimum up). The
    first holds a group of a Q8_0 tensor exactly (s is its float16 scale), the second one of Q4_1 up to s's float16
    rounding (m is its float16 minimum and every level 17 int8 steps apart); a ±x-symmetric group of float weights
    prefers the first, a skewed one the second. An all-zero group gets the smallest scale. Rows are quantized
    `INT8_QUANTIZE_CHUNK` elements at a time, in float64, the values rounded for the pair as stored, so `dequantize`
    reproduces what was compared. On a CPU with the blocked kernels, one pass of compiled code computes the same
    numbers (`cpu_kernels.quantize_groups`: all of SmolLM2's in 0.3 s instead of 5.3 s)."""
    out_f, in_f = weight.shape
    if weight.device.type == "cpu" and weight.dtype in ONE_PASS_DTYPES and in_f > 0 and _blocked_suits_cpu():
        return cpu_kernels.quantize_groups(weight, group)
    groups = -(-in_f // group)
    values = torch.empty(out_f, in_f, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_f, groups, 2, dtype=torch.float16, device=weight.device)
    step = max(1, INT8_QUANTIZE_CHUNK // max(1, in_f))
    for r in range(0, out_f, step):
        values[r : r + step], scale[r : r + step] = _quantize_rows(weight[r : r + step], group)
    return values, scale


def _quantize_rows(weight: Tensor, group: int) -> tuple[Tensor, Tensor]:
    rows, in_f = weight.shape
    groups = -(-in_f // group)
    w = weight.double()
    if groups * group != in_f:  # pad the last group with one of its own values (changing neither min nor max)
        w = torch.cat([w, w[:, -1:].expand(rows, groups * group - in_f)], 1)
    w = w.view(rows, groups, group)
    tiny = torch.finfo(torch.float16).smallest_normal
    lo, hi = w.amin(2), w.amax(2)
    sym_scale = (torch.maximum(hi, -lo) / 127).clamp(min=tiny).half()
    sym = torch.stack([sym_scale, -128 * sym_scale], 2)  # exact: times a power of two
    asym = torch.stack([((hi - lo) / 255).clamp(min=tiny).half(), lo.half()], 2)

    def fit(pair: Tensor) -> tuple[Tensor, Tensor]:
        s, m = pair[..., 0:1].double(), pair[..., 1:2].double()
        q = torch.round((w - m) / s).clamp_(0, 255)
        return q - 128, (q * s + m - w).pow_(2).sum(2)

    (q_sym, e_sym), (q_asym, e_asym) = fit(sym), fit(asym)
    use_asym = e_asym < e_sym
    q = torch.where(use_asym[..., None], q_asym, q_sym).view(rows, groups * group)[:, :in_f]
    return q.to(torch.int8), torch.where(use_asym[..., None], asym, sym)


def dequantize(values: Tensor, scale: Tensor, group: int = INT8_GROUP) -> Tensor:
    """The float32 (out, in) weight of int8 `values` (out, in) with `scale` (out, groups, 2) (`quantize_groups`)."""
    in_f = values.shape[1]
    s, m = (scale[..., i].float().repeat_interleave(group, 1)[:, :in_f] for i in (0, 1))
    return (values.float() + 128) * s + m


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
