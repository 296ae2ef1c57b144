"""Reading a Hugging Face safetensors checkpoint: only the tensors, and the slices, a shard needs.

The index is built from file headers alone (no weight bytes), which also validates every file up
front: a file that is not safetensors, or whose header promises more bytes than the file holds,
is reported by name before any loading starts. Pickle-based formats are never read.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and, where known, the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = _DTYPE_SIZES.get(self.dtype, 4)
        for d in self.shape:
            n *= d
        return n


def _read_header(path: Path) -> dict[str, TensorInfo]:
    """List a file's tensors from its header; safetensors itself rejects non-safetensors and truncated files."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            tensors = {}
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                sl = f.get_slice(name)
                tensors[name] = TensorInfo(path, tuple(sl.get_shape()), sl.get_dtype())
            return tensors
    except Exception as e:  # SafetensorError, OSError: report the file, not a traceback
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None


class Checkpoint:
    """Which file holds which tensor, with shapes and dtypes, from headers only."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._files():
            self.tensors.update(_read_header(path))

    def _files(self) -> list[Path]:
        index = self.dir / INDEX_FILE
        single = self.dir / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: malformed index ({e!r}); expected a 'weight_map' object") from None
            files = sorted({self.dir / f for f in weight_map.values()})
        elif single.is_file():
            files = [single]
        else:
            pickles = [p.name for p in self.dir.glob("*.bin")] + [p.name for p in self.dir.glob("*.pt*")]
            hint = ""
            if pickles:
                hint = f" (found {pickles}: pickle-based weights are never loaded; convert them to safetensors)"
            raise CheckpointError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE}{hint}")
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {INDEX_FILE} but missing")
        return files

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor '{name}' is missing from the checkpoint") from None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def check(self, reads: list[TensorRead]) -> None:
        """Every tensor the reads need exists with the shape the model expects (headers only)."""
        for r in reads:
            info = self.info(r.source)
            if info.shape != r.full_shape:
                raise CheckpointError(
                    f"{info.file}: tensor '{r.source}' has shape {list(info.shape)}, expected "
                    f"{list(r.full_shape)} from config.json"
                )


Index = tuple[slice, ...]


@dataclass(frozen=True)
class TensorRead:
    """Read `index` of checkpoint tensor `source` into parameter `target` (expected full shape given)."""

    target: str
    source: str
    full_shape: tuple[int, ...]
    index: Index | None


def _sliced_shape(shape: tuple[int, ...], index: Index | None) -> tuple[int, ...]:
    if index is None:
        return shape
    out = []
    for dim, s in zip(shape, index + (slice(None),) * (len(shape) - len(index)), strict=True):
        start, stop, _ = s.indices(dim)
        out.append(max(0, stop - start))
    return tuple(out)


def read_tensors(
    ckpt: Checkpoint,
    reads: list[TensorRead],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Read each requested slice, converted to `dtype`, checking shapes against what the model expects.

    Files are opened one at a time and closed after their tensors are read, so the memory-mapped
    pages of the checkpoint never stay resident beyond one file.
    """
    ckpt.check(reads)
    by_file: dict[Path, list[TensorRead]] = defaultdict(list)
    for r in reads:
        by_file[ckpt.info(r.source).file].append(r)
    total = sum(ckpt.info(r.source).nbytes * _fraction(r) for r in reads)
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=int(total),
        unit="B",
        unit_scale=True,
        desc="loading shard",
        delay=1.0,
        disable=not progress,
        file=None,
    )
    with bar:
        for path, file_reads in by_file.items():
            for r in file_reads:
                out[r.target] = _read_one(path, r, dtype, device)
                bar.update(out[r.target].numel() * out[r.target].element_size())
    return out


def _read_one(path: Path, r: TensorRead, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Copy one slice out of the file into memory we own.

    Reopened per tensor on purpose: the file's mapped pages are released when it closes, so at most
    one tensor's worth of them is resident next to the copy (peak ≈ shard bytes + one tensor), and a
    served model never depends on its checkpoint file staying unchanged on disk.
    """
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            sl = f.get_slice(r.source)
            t = sl[r.index] if r.index is not None else sl[:]
            return t.to(device=device, dtype=dtype, copy=True)
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{path}: tensor '{r.source}': cannot read: {e}") from None


def _fraction(r: TensorRead) -> float:
    whole = 1
    for d in r.full_shape:
        whole *= d
    part = 1
    for d in _sliced_shape(r.full_shape, r.index):
        part *= d
    return part / whole if whole else 0.0
