"""Reading a shard's tensors out of safetensors files: only the slices it holds, one at a time.

Which slices is decided elsewhere (`loader.meta_shard` plans a `TensorRead` per checkpoint block); the
checkpoint's index and header checks are `shardmesh.models.checkpoint`. `get_slice` reads a slice's
bytes without touching the rest of its tensor.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from shardmesh.models.checkpoint import Checkpoint, CheckpointError, TensorRead


def target_shapes(reads: list[TensorRead]) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape: its blocks stacked along dim 0 (one block: the slice's own shape)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for r in reads:
        rows = max(r.row + r.shape[0], shapes.get(r.target, (0,))[0])
        shapes[r.target] = (rows, *r.shape[1:])
    return shapes


# A finished target, its reads and the tensor they filled -> what the shard keeps of it.
Finish = Callable[[str, list[TensorRead], torch.Tensor], torch.Tensor]


def read_tensors(
    ckpt: Checkpoint,
    reads: list[TensorRead],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = True,
    finish: Finish | None = None,
) -> dict[str, torch.Tensor]:
    """Each target parameter, in `dtype` on `device`, filled block by block from its reads, then passed
    through `finish` (a quantizer) as soon as its last read is done.

    Shapes are checked against what the model expects first (headers only). Each target is allocated
    once and every slice is copied straight into its rows, converting the dtype on the way, so next to
    the shard's own bytes at most one slice and its mapped file pages are alive at a time (and with
    `finish`, one target as read next to what it is turned into).
    """
    ckpt.check(reads)
    by_file: dict[Path, list[TensorRead]] = defaultdict(list)
    by_target: dict[str, list[TensorRead]] = defaultdict(list)
    for r in reads:
        by_file[ckpt.info(r.source).file].append(r)
        by_target[r.target].append(r)
    shapes = target_shapes(reads)
    left = {target: len(rs) for target, rs in by_target.items()}
    out: dict[str, torch.Tensor] = {}
    total = sum(r.numel for r in reads) * dtype.itemsize
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="loading shard", delay=1.0, disable=not progress)
    with bar:
        for path, file_reads in by_file.items():
            for r in file_reads:
                if r.target not in out:
                    out[r.target] = torch.empty(shapes[r.target], dtype=dtype, device=device)
                _read_into(out[r.target][r.row : r.row + r.shape[0]], path, r)
                bar.update(r.numel * dtype.itemsize)
                left[r.target] -= 1
                if finish is not None and not left[r.target]:
                    out[r.target] = finish(r.target, by_target[r.target], out[r.target])
    return out


def _read_into(dst: torch.Tensor, path: Path, r: TensorRead) -> None:
    """Copy one slice out of the file into `dst`, memory we own.

    Reopened per tensor on purpose: the file's mapped pages are released when it closes, so at most
    one slice's worth of them is resident next to the copy, and a served model never depends on its
    checkpoint file staying unchanged on disk.
    """
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            sl = f.get_slice(r.source)
            dst.copy_(sl[r.index] if r.index is not None else sl[:])
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: tensor '{r.source}': cannot read: {e}") from None
