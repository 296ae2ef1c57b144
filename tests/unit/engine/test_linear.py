"""Product kernels: each computes `F.linear` on the weight it prepared, the loader picks one per shard and
prepares every product (and nothing else) once, and a module's forward is its kernel's product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import ShardSpec
from shardmesh.engine import cpu_kernels, linear
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import (
    DENSE,
    KERNEL_ENV,
    Block,
    BlockedCpuKernel,
    BlockedInt8Kernel,
    DenseKernel,
    InputMajorKernel,
    Int8BF16Kernel,
    Int8CpuKernel,
    Int8DequantKernel,
    Int8FP32Kernel,
    Linear,
    LinearProduct,
    OneDNNPackedKernel,
    choose_kernel,
    cpu_has_native_bf16,
    quantize_rows,
)
from shardmesh.engine.loader import build_shard
from tests.checkpoints import make_checkpoint

ONEDNN = torch.backends.mkldnn.is_available()
KERNELS = [DenseKernel(), InputMajorKernel()] + ([OneDNNPackedKernel()] if ONEDNN else [])


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: type(k).__name__)
def test_each_kernel_computes_the_dense_product(kernel, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 48, generator=g), torch.randn(96, generator=g), torch.randn(rows, 48, generator=g)
    prepared = kernel.prepare(w)
    assert torch.equal(kernel.dense(prepared), w)  # same values, whatever the layout
    # Summation order differs between GEMMs: float32 rounding, ~1e-6 relative at these sizes.
    torch.testing.assert_close(kernel(x, prepared, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel(x, prepared), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_input_major_stores_the_transpose_contiguously() -> None:
    w = torch.randn(8, 4)
    prepared = InputMajorKernel().prepare(w)
    assert prepared.shape == w.shape and prepared.t().is_contiguous() and not prepared.is_contiguous()


def test_kernel_chosen_from_device_dtype_and_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_kernel(torch.float32, "cuda") is DENSE
    assert choose_kernel(torch.bfloat16, torch.device("cuda", 0)) is DENSE
    assert type(choose_kernel(torch.float16, "cpu")) is InputMajorKernel
    # float32 and bfloat16: the blocked kernel on AVX-512 where it builds, else oneDNN's packed product / input-major
    blocked = linear._blocked_suits_cpu()
    for dtype in (torch.float32, torch.bfloat16):
        fallback = InputMajorKernel if dtype == torch.bfloat16 or not ONEDNN else OneDNNPackedKernel
        assert type(choose_kernel(dtype, "cpu")) is (BlockedCpuKernel if blocked else fallback)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # no AVX-512: PyTorch's products
    assert type(choose_kernel(torch.float32, "cpu")) is (OneDNNPackedKernel if ONEDNN else InputMajorKernel)
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx512f"}))
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert type(choose_kernel(torch.bfloat16, "cpu")) is InputMajorKernel
    assert type(choose_kernel(torch.float32, "cpu")) is (OneDNNPackedKernel if ONEDNN else InputMajorKernel)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert type(choose_kernel(torch.float32, "cpu")) is InputMajorKernel


class _Doubling(DenseKernel):
    """A kernel that is not `F.linear`, to show that forward is the kernel's product and nothing else."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        return 2 * super().__call__(x, weight, bias)


def test_forward_is_the_kernels_product() -> None:
    lin = Linear(4, 3, bias=True)
    x = torch.randn(2, 4)
    dense = F.linear(x, lin.weight, lin.bias)
    lin.use_kernel(_Doubling())
    torch.testing.assert_close(lin(x), 2 * dense)
    assert not lin.weight.requires_grad


def test_blocks_must_add_up_to_the_output_features() -> None:
    Linear(4, 5, bias=False, blocks=(Block("a", 3), Block("b", 2)))
    with pytest.raises(ValueError, match="do not add up to 6"):
        Linear(4, 6, bias=False, blocks=(Block("a", 3), Block("b", 2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [1, 2])
def test_loader_prepares_every_product_and_nothing_else(tmp_path: Path, dtype: torch.dtype, tp: int) -> None:
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2)
    model = build_shard(d, ShardSpec(0, 2, 2, tp - 1, tp), UnboundGroup(tp - 1, tp), dtype=dtype, progress=False)
    kind = type(choose_kernel(dtype, "cpu"))
    products = [m for m in model.modules() if isinstance(m, LinearProduct)]
    assert len(products) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    assert all(type(m.kernel) is kind for m in products)
    if kind is InputMajorKernel:
        assert all(m.weight.t().is_contiguous() for m in products)
    for m in model.modules():  # lookups and norms keep their plain row-major weights
        if not isinstance(m, LinearProduct) and isinstance(getattr(m, "weight", None), nn.Parameter):
            assert not m.weight.is_mkldnn and m.weight.is_contiguous()


# -- int8 ---------------------------------------------------------------------------------------------------------


def test_int8_rows_round_to_the_nearest_step_of_their_own_scale() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [-254.0, 127.0, 1.0]])
    scale, q = quantize_rows(w, w.abs().amax(1))
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q.tolist() == [[127, -64, 32], [0, 0, 0], [-127, 64, 0]]  # 63.5 and 0.5 round to even
    torch.testing.assert_close(scale, torch.tensor([1 / 127, torch.finfo(torch.float32).tiny, 2.0]))
    # A larger maximum over the whole row (columns another rank holds) coarsens the step, as it must.
    scale, q = quantize_rows(w[:1, :2], torch.tensor([2.0]))
    assert q.tolist() == [[64, -32]]


INT8_KERNELS = (
    [Int8DequantKernel(), Int8FP32Kernel(), Int8CpuKernel()]
    + ([Int8BF16Kernel()] if cpu_has_native_bf16() else [])
    + ([BlockedInt8Kernel()] if cpu_kernels.available() else [])
)


# int8-cpu: a row alone, blocks of four and a tail, the GEMM; int8-blocked: rows by eight, four and the rest
@pytest.mark.parametrize("rows", [1, 3, 7, 9, 13])
@pytest.mark.parametrize("kernel", INT8_KERNELS, ids=lambda k: k.name)
def test_each_int8_kernel_multiplies_by_the_dequantized_weight(kernel, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(rows, 64, generator=g)
    scale, q = quantize_rows(w, w.abs().amax(1))
    weight, prepared_scale = kernel.prepare(q), kernel.prepare_scale(scale)
    dense = q.float() * scale[:, None]
    assert torch.equal(kernel.dense(weight, prepared_scale), dense) or kernel.name == "int8-bf16"
    # int8-bf16 rounds x and the product to bfloat16 (8 bits of mantissa: 2^-8 relative, a few 1e-2 here).
    tol = 5e-2 if kernel.name == "int8-bf16" else 1e-5
    torch.testing.assert_close(kernel(x, weight, b, prepared_scale), F.linear(x, dense, b), rtol=tol, atol=tol)


def test_int8_kernel_chosen_from_the_cpu_and_named_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardmesh.engine.linear as linear

    monkeypatch.setattr(linear, "cpu_has_native_bf16", lambda: True)  # bfloat16 activations: never chosen
    blocked = linear._blocked_suits_cpu()
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is (BlockedInt8Kernel if blocked
                                                                         else Int8CpuKernel)  # fmt: skip
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma"}))  # no AVX-512: the int8-cpu loop
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8CpuKernel
    monkeypatch.setattr(linear.int8_cpu, "available", lambda: False)  # no compiler here
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8FP32Kernel
    assert type(choose_kernel(torch.float16, "cpu", quantized=True)) is Int8DequantKernel
    assert type(choose_kernel(torch.bfloat16, "cuda", quantized=True)) is Int8DequantKernel
    monkeypatch.setenv(KERNEL_ENV, "int8-bf16")
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8BF16Kernel
    assert type(choose_kernel(torch.float32, "cpu")) is not Int8BF16Kernel  # it reads float weights: not for it
    monkeypatch.setenv(KERNEL_ENV, "int4")
    with pytest.raises(ValueError, match="SHARDMESH_LINEAR_KERNEL='int4': expected one of"):
        choose_kernel(torch.float32, "cpu")


@pytest.mark.parametrize("tp", [1, 2])
def test_int8_shards_hold_the_same_numbers_at_every_tp_degree(tmp_path: Path, tp: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Scales come from whole checkpoint rows, so the row-parallel slices of tp ranks put together are the
    tp=1 shard's int8 values and scales; the embedding, norms and LM head stay in float."""
    monkeypatch.setenv(KERNEL_ENV, "int8-dequant")  # float32 scales as made (int8-bf16 stores them in bfloat16)
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2)
    spec = ShardSpec(0, 2, 2)
    full = build_shard(d, spec, dtype=torch.float32, progress=False, quantization=Quantization.INT8)
    products = {n: m for n, m in full.named_modules() if isinstance(m, LinearProduct)}
    assert {n for n, m in products.items() if m.weight.dtype == torch.int8} == set(products) - {"lm_head"}
    assert full.lm_head.weight_scale is None and full.model.embed_tokens.weight.dtype == torch.float32
    float_model = build_shard(d, spec, dtype=torch.float32, progress=False)
    for name, m in products.items():  # each value within half a step of the float weight
        if m.weight_scale is not None:
            w = float_model.get_submodule(name).kernel.dense(float_model.get_submodule(name).weight)
            err = (m.kernel.dense(m.weight, m.weight_scale) - w).abs()
            assert bool((err <= m.weight_scale.float()[:, None] / 2 * 1.001).all()), name
    parts = [build_shard(d, ShardSpec(0, 2, 2, r, tp), UnboundGroup(r, tp), progress=False,
                         quantization=Quantization.INT8) for r in range(tp)]  # fmt: skip
    for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):  # row-parallel
        whole = products[name]
        pieces = [p.get_submodule(name) for p in parts]
        assert torch.equal(torch.cat([p.weight for p in pieces], dim=1), whole.weight)
        assert all(torch.equal(p.weight_scale, whole.weight_scale) for p in pieces)
