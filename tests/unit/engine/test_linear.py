"""Product kernels: each computes `F.linear` on the weight it prepared, the loader picks one per shard and
prepares every product (and nothing else) once, and a module's forward is its kernel's product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import (
    DENSE,
    Block,
    DenseKernel,
    InputMajorKernel,
    Linear,
    LinearProduct,
    OneDNNPackedKernel,
    choose_kernel,
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
    assert type(choose_kernel(torch.bfloat16, "cpu")) is InputMajorKernel
    assert type(choose_kernel(torch.float16, "cpu")) is InputMajorKernel
    assert type(choose_kernel(torch.float32, "cpu")) is (OneDNNPackedKernel if ONEDNN else InputMajorKernel)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert type(choose_kernel(torch.float32, "cpu")) is InputMajorKernel


class _Doubling(DenseKernel):
    """A kernel that is not `F.linear`, to show that forward is the kernel's product and nothing else."""

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
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
