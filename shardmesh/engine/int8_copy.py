"""An int8 copy of a checkpoint's decoder-layer products, written once into the cache, for a memory budget to stream.

A shard served with `--quantize int8` under `--memory-budget` keeps its leading layers resident, quantized at load as
any int8 shard's are, and streams the others' products every step (`offload`). Streamed from a float checkpoint they
would bring in four (float32) or two (bfloat16) times the bytes the int8 product reads, and be quantized again at
every step. So the first load writes each of the shard's layers' products in int8, one safetensors file per layer,
under `<cache>/int8/<key>/` (`cache.default_cache_dir`), and the streamer maps those as they lie:

  model.layers.N.<module>.<proj>.weight        int8 (out, in)
  model.layers.N.<module>.<proj>.weight_scale  float16 (out, groups, 2): each `INT8_GROUP` inputs' scale and minimum

the checkpoint's own tensor names with compressed-tensors' `weight_scale` beside them (the scale tensor holds a
group's minimum too: `linear.quantize_groups`). Each tensor is quantized whole, rows in chunks, from its values in
the serving dtype: a tensor-parallel rank streams its slice of the same numbers, which are the numbers a resident
int8 layer holds wherever its slice starts on a group (column slices: always; row-parallel slices of inputs: at a
multiple of `INT8_GROUP`, which `int8_reads` requires).

The key is a digest of the checkpoint's files (resolved path, size, modification time), the serving dtype and the
group size: a checkpoint rewritten in place gets a new copy. A layer's file is written under a temporary name and
renamed into place, so workers writing the same layer at once leave one whole file, and a load interrupted midway
leaves none half-written.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from shardmesh.core.dtypes import INT8_GROUP
from shardmesh.engine.linear import quantize_groups
from shardmesh.models.cache import default_cache_dir
from shardmesh.models.checkpoint import Checkpoint, CheckpointError, TensorRead

FORMAT = 1  # bumped when the files' layout changes: a new key, so no old copy is read
CHUNK_BYTES = 64 * 2**20  # float rows quantized at a time (their float64 temporaries are a few times this)


def scale_name(name: str) -> str:
    """`...q_proj.weight` -> `...q_proj.weight_scale`: the scale tensor beside an int8 weight."""
    return name + "_scale"


def copy_dir(ckpt: Checkpoint, dtype: torch.dtype, cache_dir: Path | None = None) -> Path:
    """Where the int8 copy of `ckpt`'s layers quantized from `dtype` values lies (written or not)."""
    digest = hashlib.sha256(f"{FORMAT} {INT8_GROUP} {dtype}".encode())
    for path in sorted({info.file for info in ckpt.tensors.values()}):
        st = path.stat()
        digest.update(f"\n{path.resolve()} {st.st_size} {st.st_mtime_ns}".encode())
    return (cache_dir or default_cache_dir()) / "int8" / digest.hexdigest()[:20]


def layer_file(directory: Path, layer: int) -> Path:
    return directory / f"layer-{layer:05d}.safetensors"


def ensure_copy(
    ckpt: Checkpoint, sources: dict[int, list[str]], dtype: torch.dtype, progress: bool = True
) -> Checkpoint:
    """The int8 copy of the products `sources` lists per layer (checkpoint tensor names), each layer's file written
    now if the cache lacks it, as a `Checkpoint` over those files."""
    directory = copy_dir(ckpt, dtype)
    missing = {i: names for i, names in sources.items() if not layer_file(directory, i).is_file()}
    if missing:
        directory.mkdir(parents=True, exist_ok=True)
        total = sum(ckpt.info(n).nbytes for names in missing.values() for n in names)
        with tqdm(total=total, unit="B", unit_scale=True, desc="int8 copy of streamed layers", delay=1.0,
                  disable=not progress) as bar:  # fmt: skip
            for i, names in sorted(missing.items()):
                _write_layer(ckpt, names, dtype, layer_file(directory, i), bar)
    return Checkpoint(directory, [layer_file(directory, i) for i in sorted(sources)])


def _write_layer(ckpt: Checkpoint, names: Iterable[str], dtype: torch.dtype, path: Path, bar: tqdm) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        tensors[name], tensors[scale_name(name)] = _quantize(ckpt, name, dtype, bar)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, os.fspath(tmp), metadata={"format": "pt", "quantization": f"int8-groups-{INT8_GROUP}"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _quantize(ckpt: Checkpoint, name: str, dtype: torch.dtype, bar: tqdm) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpoint matrix quantized whole (`quantize_groups`), read and quantized a chunk of rows at a time."""
    info = ckpt.info(name)
    if len(info.shape) != 2:
        raise CheckpointError(f"{info.file}: tensor '{name}' has shape {list(info.shape)}: an int8 product is 2-D")
    rows, cols = info.shape
    values = torch.empty(rows, cols, dtype=torch.int8)
    scale = torch.empty(rows, -(-cols // INT8_GROUP), 2, dtype=torch.float16)
    step = max(1, CHUNK_BYTES // (4 * cols))
    try:
        with safe_open(os.fspath(info.file), framework="pt") as f:
            sl = f.get_slice(name)
            for r in range(0, rows, step):
                chunk = sl[r : r + step].to(dtype)
                values[r : r + step], scale[r : r + step] = quantize_groups(chunk)
                bar.update(chunk.shape[0] * cols * (info.nbytes // (rows * cols)))
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"{info.file}: tensor '{name}': cannot read: {e}") from None
    return values, scale


def int8_reads(r: TensorRead) -> tuple[TensorRead, TensorRead]:
    """A product's float read as its two reads in the int8 copy: the int8 weight, sliced alike, and its scales, the
    same rows and the groups of the same inputs (`weight_scale`). ValueError for a slice of inputs that does not
    start on a group (or end on one, short of the last input): its groups would not be the copy's."""
    out_f, in_f = r.full_shape
    index = r.index or ()
    rows = index[0] if index else slice(None)
    groups = slice(None)
    if len(index) > 1:
        start, stop, _ = index[1].indices(in_f)
        if start % INT8_GROUP or (stop != in_f and stop % INT8_GROUP):
            raise ValueError(
                f"--quantize int8 with --memory-budget: '{r.source}' is split at inputs [{start}, {stop}) of {in_f}, "
                f"not at multiples of the int8 group ({INT8_GROUP}); choose a tensor-parallel degree that splits it "
                f"there, or serve it resident"
            )
        groups = slice(start // INT8_GROUP, -(-stop // INT8_GROUP))
    scale_index = (rows, groups) if len(index) > 1 else ((rows,) if index else None)
    full_groups = -(-in_f // INT8_GROUP)
    scale = TensorRead(scale_name(r.target), scale_name(r.source), (out_f, full_groups, 2), scale_index, r.row)
    return r, scale
