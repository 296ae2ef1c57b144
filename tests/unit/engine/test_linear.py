"""Product kernels: each computes `F.linear` on the weight it prepared, the loader picks one per shard and
prepares every product (and nothing else) once, and a module's forward is its kernel's product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.dtypes import INT8_GROUP, Quantization
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
    Int8CpuKernel,
    Int8DequantKernel,
    Linear,
    LinearProduct,
    OneDNNPackedKernel,
    choose_kernel,
    dequantize,
    quantize_groups,
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
    # float32 and bfloat16: the blocked kernel on AVX-512 or AVX2 + FMA + F16C where it builds, else oneDNN's packed
    # product / input-major
    blocked = linear._blocked_suits_cpu()
    for dtype in (torch.float32, torch.bfloat16):
        fallback = InputMajorKernel if dtype == torch.bfloat16 or not ONEDNN else OneDNNPackedKernel
        assert type(choose_kernel(dtype, "cpu")) is (BlockedCpuKernel if blocked else fallback)
    built = cpu_kernels.available()
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))  # AVX2 alone: blocked too
    assert type(choose_kernel(torch.float32, "cpu")) is (BlockedCpuKernel if built else OneDNNPackedKernel
                                                         if ONEDNN else InputMajorKernel)  # fmt: skip
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))  # neither: PyTorch's products
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


def test_int8_groups_hold_q8_0_and_q4_1_blocks_exactly() -> None:
    """A group of a Q8_0 tensor (d · q, |q| ≤ 127 reaching 127, d a float16) takes the symmetric grid and comes back
    exactly; a group of Q4_1 (m + d · k, k = 0..15 from its minimum to its maximum) the asymmetric one, exact up to
    its scale d / 17 rounded to float16. A zero group stays zero."""
    g = torch.Generator().manual_seed(0)
    q8 = torch.randint(-127, 128, (3, 32), generator=g).float()
    q8[:, 5] = 127.0
    q41 = torch.randint(0, 16, (3, 32), generator=g).float()
    q41[:, 0], q41[:, 1] = 0.0, 15.0
    d = torch.tensor([[0.01], [0.002], [0.5]]).half().float()
    m = torch.tensor([[-0.07], [0.001], [-4.0]]).half().float()
    w = torch.cat([d * q8, m + d * q41, torch.zeros(3, 32)], 1)  # groups: Q8_0, Q4_1, zeros
    values, scale = quantize_groups(w)
    assert values.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (3, 3, 2)
    assert torch.equal(scale[:, 0, 0].float(), d[:, 0]) and torch.equal(scale[:, 1, 1].float(), m[:, 0])
    back = dequantize(values, scale)
    assert torch.equal(back[:, :32], w[:, :32]) and torch.equal(back[:, 64:], w[:, 64:])
    assert bool(((back[:, 32:64] - w[:, 32:64]).abs() <= d * 2**-8).all())  # 255 steps of d/17 (1 + 2^-11)
    assert torch.equal((values[:, 32:64].int() + 128) % 17, torch.zeros(3, 32, dtype=torch.int32))


@pytest.mark.parametrize("cols", [32, 72, 5])
def test_int8_groups_round_to_the_nearest_step_a_short_last_group_included(
    cols: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every weight within half a step of its group's grid, the last group shorter when the inputs are not a multiple
    of the group; quantizing a few rows at a time gives the same numbers as all at once."""
    g = torch.Generator().manual_seed(cols)
    w = torch.randn(20, cols, generator=g) + torch.rand(20, 1, generator=g)  # skewed rows
    values, scale = quantize_groups(w)
    assert scale.shape == (20, -(-cols // INT8_GROUP), 2)
    step = scale[..., 0].repeat_interleave(INT8_GROUP, 1)[:, :cols]
    assert bool(((dequantize(values, scale) - w).abs() <= step.float() / 2 * 1.01).all())
    monkeypatch.setattr(linear, "INT8_QUANTIZE_CHUNK", 3 * cols)  # three rows at a time
    again = quantize_groups(w)
    assert torch.equal(again[0], values) and torch.equal(again[1], scale)


def _int8_cases() -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(*shape, generator=g) * 0.05).to(dtype)
             for shape in [(33, 100), (7, 31), (5, 1), (64, 576)]
             for dtype in (torch.float32, torch.bfloat16, torch.float16)]  # fmt: skip
    cases.append(torch.randn(40, 256, generator=g).abs())  # skewed: the asymmetric grid
    d = (torch.rand(40, 8, 1, generator=g) * 0.01).half().float()
    cases.append((torch.randint(-127, 128, (40, 8, 32), generator=g) * d).view(40, 256))  # Q8_0 blocks
    m = -torch.rand(40, 8, 1, generator=g).half().float()
    cases.append((torch.randint(0, 16, (40, 8, 32), generator=g) * d + m).view(40, 256))  # Q4_1 blocks
    zeros = torch.zeros(4, 64)
    zeros[1, 5] = 1e-9  # below float16's smallest normal scale
    return [*cases, zeros]


@pytest.mark.skipif(not cpu_kernels.available(), reason="the kernels need a C++ compiler")
def test_the_one_pass_quantizer_gives_the_torch_paths_numbers_to_the_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cpu_kernels.quantize_groups` computes, group by group in compiled code, what the float64 tensors of
    `linear._quantize_rows` do: the same int8 values and float16 scales and minima, for float32, bfloat16 and
    float16 weights, short last groups, both grids, all-zero groups. `quantize_groups` takes it on such a CPU."""
    for w in _int8_cases():
        values, scale = cpu_kernels.quantize_groups(w, INT8_GROUP)
        ref_values, ref_scale = linear._quantize_rows(w, INT8_GROUP)
        assert torch.equal(values, ref_values), (w.shape, w.dtype)
        assert torch.equal(scale.view(torch.int16), ref_scale.view(torch.int16)), (w.shape, w.dtype)
    w = _int8_cases()[0]
    taken: list[Tensor] = []
    monkeypatch.setattr(cpu_kernels, "quantize_groups", lambda w, group: taken.append(w) or (w, w))
    quantize_groups(w)
    assert len(taken) == 1
    monkeypatch.setattr(linear, "_blocked_suits_cpu", lambda: False)  # a CPU without the kernels: torch's tensors
    assert torch.equal(quantize_groups(w)[0], linear._quantize_rows(w, INT8_GROUP)[0]) and len(taken) == 1


INT8_KERNELS = [Int8DequantKernel(), Int8CpuKernel()] + ([BlockedInt8Kernel()] if cpu_kernels.available() else [])


# int8-cpu: a row alone and several, the GEMM past its rows; int8-blocked: rows by eight, four and the rest (one and
# two rows with two sets of sums, each group's inputs in pairs); 72 inputs: two groups and a short one, 71: a short
# one of an odd length, 104: three groups (int8-cpu takes whole groups two at a time: one left) and a short one
@pytest.mark.parametrize("k", [72, 71, 104])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 9, 10, 13])
@pytest.mark.parametrize("kernel", INT8_KERNELS, ids=lambda k: k.name)
def test_each_int8_kernel_multiplies_by_the_dequantized_weight(kernel, rows: int, k: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, k, generator=g) - 0.3, torch.randn(96, generator=g), torch.randn(rows, k, generator=g)
    values, scale = quantize_groups(w)
    weight, prepared_scale = kernel.prepare(values), kernel.prepare_scale(scale)
    dense = dequantize(values, scale)
    assert torch.equal(kernel.dense(weight, prepared_scale), dense)
    torch.testing.assert_close(kernel(x, weight, b, prepared_scale), F.linear(x, dense, b), rtol=1e-5, atol=1e-5)


def test_int8_kernel_chosen_from_the_cpu_and_named_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardmesh.engine.linear as linear

    blocked = linear._blocked_suits_cpu()
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is (BlockedInt8Kernel if blocked
                                                                         else Int8CpuKernel)  # fmt: skip
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))  # AVX2: blocked, if built
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is (BlockedInt8Kernel if blocked
                                                                         else Int8CpuKernel)  # fmt: skip
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx"}))  # no AVX2: the int8-cpu loop
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8CpuKernel
    monkeypatch.setattr(linear.int8_cpu, "available", lambda: False)  # no compiler here
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8DequantKernel
    assert type(choose_kernel(torch.float16, "cpu", quantized=True)) is Int8DequantKernel
    assert type(choose_kernel(torch.bfloat16, "cuda", quantized=True)) is Int8DequantKernel
    monkeypatch.setenv(KERNEL_ENV, "int8-cpu")
    assert type(choose_kernel(torch.float32, "cpu", quantized=True)) is Int8CpuKernel
    assert type(choose_kernel(torch.float32, "cpu")) is not Int8CpuKernel  # it reads int8 weights: not for floats
    monkeypatch.setenv(KERNEL_ENV, "int4")
    with pytest.raises(ValueError, match="SHARDMESH_LINEAR_KERNEL='int4': expected one of"):
        choose_kernel(torch.float32, "cpu")


@pytest.mark.parametrize("tp", [1, 2])
def test_int8_shards_hold_the_same_numbers_at_every_tp_degree(tmp_path: Path, tp: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Groups run along the inputs, and a row-parallel slice of whole groups (head dim 16 x 2 heads, 64 of the FFN's
    128) holds the groups of the unsliced product: the tp ranks' values and scales put together are the tp=1
    shard's. The LM head is int8 too; the embedding and norms stay in float."""
    monkeypatch.setenv(KERNEL_ENV, "int8-dequant")  # values and scales as made, unblocked
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, hidden_size=64, intermediate_size=128)
    spec = ShardSpec(0, 2, 2)
    full = build_shard(d, spec, dtype=torch.float32, progress=False, quantization=Quantization.INT8)
    products = {n: m for n, m in full.named_modules() if isinstance(m, LinearProduct)}
    assert {n for n, m in products.items() if m.weight.dtype == torch.int8} == set(products)
    assert full.model.embed_tokens.weight.dtype == torch.float32
    float_model = build_shard(d, spec, dtype=torch.float32, progress=False)
    for name, m in products.items():  # each value within half a step of the float weight
        if m.weight_scale is not None:
            w = float_model.get_submodule(name).kernel.dense(float_model.get_submodule(name).weight)
            err = (m.kernel.dense(m.weight, m.weight_scale) - w).abs()
            step = m.weight_scale[..., 0].repeat_interleave(INT8_GROUP, 1)[:, : w.shape[1]]
            assert bool((err <= step.float() / 2 * 1.01).all()), name
    parts = [build_shard(d, ShardSpec(0, 2, 2, r, tp), UnboundGroup(r, tp), progress=False,
                         quantization=Quantization.INT8) for r in range(tp)]  # fmt: skip
    for name in ("model.layers.1.self_attn.o_proj", "model.layers.0.mlp.down_proj"):  # row-parallel
        whole = products[name]
        pieces = [p.get_submodule(name) for p in parts]
        assert torch.equal(torch.cat([p.weight for p in pieces], dim=1), whole.weight)
        assert torch.equal(torch.cat([p.weight_scale for p in pieces], dim=1), whole.weight_scale)


def test_int8_slices_of_partial_groups_are_quantized_on_their_own_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head dim 12: at tp=2 the attention output's slices hold 24 inputs, not whole groups of 32, so each rank's groups
    start at its slice; its weights are still within half a step of the float ones, and the loader says which
    products differ from other degrees."""
    from structlog.testing import capture_logs

    monkeypatch.setenv(KERNEL_ENV, "int8-dequant")
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=1)
    float_model = build_shard(d, ShardSpec(0, 1, 1), dtype=torch.float32, progress=False)
    with capture_logs() as logs:
        part = build_shard(d, ShardSpec(0, 1, 1, 1, 2), UnboundGroup(1, 2), progress=False,
                           quantization=Quantization.INT8)  # fmt: skip
    split = {e["product"] for e in logs if e["event"] == "int8_groups_split"}
    assert split == {"model.layers.0.self_attn.o_proj.weight"}  # the FFN's 64 split in 32s: whole groups
    m = part.get_submodule("model.layers.0.self_attn.o_proj")
    w = float_model.get_submodule("model.layers.0.self_attn.o_proj")
    w = w.kernel.dense(w.weight)[:, 24:]
    assert m.weight_scale.shape == (48, 1, 2)
    err = (m.kernel.dense(m.weight, m.weight_scale) - w).abs()
    assert bool((err <= m.weight_scale[..., 0].float() / 2 * 1.01).all())
