"""A Hugging Face safetensors checkpoint from its file headers alone: which file holds which tensor, and
whether every tensor a shard will read is there with the shape the model expects.

No weight byte is read here (and no torch is imported), so planning can check a checkpoint as cheaply
as loading does. Building the index validates every file up front, with the checks the safetensors
library applies when it opens one: a file that is not safetensors, or whose header promises more bytes
than the file holds, is reported by name before any loading starts. Pickle-based formats are never read.

File layout (the safetensors format): an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the tensors'
bytes, back to back, with offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # fmt: skip
_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and, where known, the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0  # of its first byte in `file` (after the 8-byte length and the header)

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * _numel(self.shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _parse_header(path: Path, raw: bytes, data_len: int) -> dict[str, TensorInfo]:
    """The tensors a header lists; their bytes must tile [0, data_len) exactly, as safetensors requires."""
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, offsets = _entry(name, entry)
        begin, end = offsets
        if end - begin != DTYPE_SIZES[dtype] * _numel(shape):
            raise ValueError(f"tensor '{name}': data_offsets {offsets} do not fit shape {shape} of {dtype}")
        tensors[name] = TensorInfo(path, shape, dtype, 8 + len(raw) + begin)
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"tensor '{name}': data starts at byte {begin}, expected {at}")
        at = end
    if at != data_len:
        raise ValueError(f"header describes {at} bytes of tensor data, the file holds {data_len}")
    return tensors


def _entry(name: str, entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (TypeError, KeyError):
        raise ValueError(f"tensor '{name}': expected dtype, shape and data_offsets") from None
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor '{name}': unknown dtype {dtype!r}")
    lists = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
    if not lists or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in [*shape, *offsets]):
        raise ValueError(f"tensor '{name}': shape and data_offsets must be lists of non-negative integers")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def read_header(path: Path) -> dict[str, TensorInfo]:
    """List a file's tensors from its header, refusing what the safetensors library would refuse to open."""
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            return _parse_header(path, f.read(n), size - 8 - n)
    except (OSError, ValueError, struct.error) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None


class Checkpoint:
    """Which file holds which tensor, with shapes and dtypes, from headers only."""

    def __init__(self, model_dir: str | Path, files: list[Path] | None = None) -> None:
        """The checkpoint in `model_dir` (its index, or its single file), or the tensors of `files` there (a
        cache's own files, listed by whoever wrote them)."""
        self.dir = Path(model_dir)
        self.tensors: dict[str, TensorInfo] = {}
        for path in self._files() if files is None else files:
            self.tensors.update(read_header(path))

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
    """Read `index` of checkpoint tensor `source` (expected full shape given) into parameter `target`,
    at its rows [row, row + shape[0]): a fused parameter (q, k and v stacked) is filled by several reads."""

    target: str
    source: str
    full_shape: tuple[int, ...]
    index: Index | None
    row: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the slice read: `full_shape` cut by `index` (steps of 1; missing dims whole)."""
        if self.index is None:
            return self.full_shape
        index = self.index + (slice(None),) * (len(self.full_shape) - len(self.index))
        return tuple(len(range(*s.indices(dim))) for dim, s in zip(self.full_shape, index, strict=True))

    @property
    def numel(self) -> int:
        return _numel(self.shape)
