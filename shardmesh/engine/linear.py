"""The matrix products of a CPU shard, in the layout that reads weights fastest.

A decode step is a few rows times every weight matrix: memory-bound matrix-vector work. On this
2-core machine PyTorch's default GEMM for such shapes streams weights at ~16-20 GB/s and does not
use the second core for one row, while oneDNN's inner product on weights pre-packed into its
blocked layout does (measured, fp32, 60 distinct 576x1536 matrices, 2 threads: 9.9 vs 12.7 ms for one
row, 13.4 vs 27.5 ms for 16 rows; the whole SmolLM2 step in process: 42 -> 31 ms for one sequence,
108 -> 67 ms for 16). So a float32 CPU shard re-stores each matrix once, after loading, as a packed
oneDNN tensor wrapped in the same Parameter name and shape, and `linear` picks the packed product
when the weight is one. Everything else (CUDA, other dtypes, no oneDNN) keeps `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The batch size oneDNN chooses the packed layout for. Not 1, though decode multiplies one row per sequence:
# the layout picked for 16 rows streams weights faster at every batch size measured (SmolLM2, all 121
# products, fp32, 2 threads: 1 row 16.0 -> 10.5 ms, 16 rows 33.4 -> 22.7 ms, 64 rows 86 -> 66 ms; the
# whole in-process step, 1 sequence: 23.8 -> 16.4 ms, 16 sequences: 60.9 -> 48.7 ms; 1 thread, layers
# 0-15: 13.3 -> 9.9 ms). 8 was in between, 32 and 64 the same as 16.
PACK_ROWS = 16


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, computed by oneDNN when `weight` was packed by `pack_weights`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) whose product goes through `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_weights(model: nn.Module, skip: tuple[type, ...] = (nn.Embedding,)) -> int:
    """Re-store every 2-D weight that a product reads (not embeddings: lookups read rows) as a packed
    oneDNN tensor, one matrix at a time so that only one dense original is alive beside its copy.
    Returns how many were packed. The values are unchanged (`weight.to_dense()` gives them back)."""
    packed = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, skip) or not isinstance(w, nn.Parameter) or w.dim() != 2 or w.is_mkldnn:
            continue
        module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_ROWS),
                                     requires_grad=False)  # fmt: skip
        packed += 1
    return packed


def dense(t: Tensor) -> Tensor:
    """A weight's values as a plain tensor, packed or not (for inspection and tests; it copies a packed one)."""
    return t.to_dense() if t.is_mkldnn else t
