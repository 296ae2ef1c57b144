"""Reads fill each parameter block by block: every slice lands in its rows, converted to the serving dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardmesh.engine.reads import read_tensors, target_shapes
from shardmesh.models.checkpoint import Checkpoint, CheckpointError, TensorRead


@pytest.fixture
def ckpt(tmp_path: Path) -> Checkpoint:
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (6, 3), "b": (4, 3), "c": (5,)}
    save_file({name: torch.randn(shape, generator=g) for name, shape in shapes.items()}, tmp_path / "model.safetensors")
    return Checkpoint(tmp_path)


def _stacked() -> list[TensorRead]:
    """ab = [a[2:4]; b[1:3]], the way a rank's qkv is its own rows of q, k and v; c whole."""
    return [
        TensorRead("ab", "a", (6, 3), (slice(2, 4),), 0),
        TensorRead("ab", "b", (4, 3), (slice(1, 3),), 2),
        TensorRead("c", "c", (5,), None),
    ]


def test_target_shapes_stack_blocks_by_rows() -> None:
    assert target_shapes(_stacked()) == {"ab": (4, 3), "c": (5,)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_slice_lands_in_its_rows(ckpt: Checkpoint, tmp_path: Path, dtype: torch.dtype) -> None:
    want = load_file(tmp_path / "model.safetensors")
    got = read_tensors(ckpt, _stacked(), dtype, progress=False)
    assert set(got) == {"ab", "c"} and {t.dtype for t in got.values()} == {dtype}
    assert torch.equal(got["ab"], torch.cat([want["a"][2:4], want["b"][1:3]]).to(dtype))
    assert torch.equal(got["c"], want["c"].to(dtype))


def test_shapes_are_checked_before_any_read(ckpt: Checkpoint) -> None:
    with pytest.raises(CheckpointError, match=r"tensor 'b' has shape \[4, 3\], expected \[5, 3\]"):
        read_tensors(ckpt, [TensorRead("x", "b", (5, 3), None)], torch.float32, progress=False)
