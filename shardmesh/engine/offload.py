"""Offload: a shard larger than its memory budget keeps some decoder layers resident and streams the others in
from the checkpoint for every step (`build_shard(..., memory_budget=N)`, `shardmesh generate --memory-budget`).

What is resident: everything `build_shard` loads today except the weight matrices of the streamed layers, i.e.
the embedding, the final norm and the LM head, every weight of the leading decoder layers that fit, and the norms
and biases of the streamed layers (a few KiB each: they stay, so every layer keeps real parameters and
`Transformer.dtype`, `make_cache` and the parameter byte counts work unchanged).

What streams: the four products' weight matrices (qkv, o, gate_up, down: all but a few KiB of a layer) of the
trailing layers that do not fit. Each stays in its safetensors file, memory-mapped once, and a step multiplies
the mapped pages directly (zero copy: `torch.frombuffer` over the tensor's bytes, sliced to this tp rank's share,
the product of `cpu_kernels.rows_linear` on float32 decode rows, F.linear otherwise, a stacked qkv / gate_up block
by block since the checkpoint stores its blocks apart).
Zero copy needs the checkpoint's dtype to be the serving dtype; otherwise each layer is copy-converted into one of
two reusable buffers (`streamed-copy`). The streamed products' kernel is `StreamedKernel`; the resident ones keep
the kernel `linear.choose_kernel` picks (so streamed and resident products differ by rounding only: the packed
oneDNN product and the dense one sum in different orders).

An int8 shard (`Quantization.INT8`) streams its layers' products from the int8 copy of the checkpoint's layers
(`int8_copy`: int8 values and float16 scales, written once into the cache at the first load), zero copy: the plan
counts every product's int8 bytes, resident or streamed (`Int8Streams`), and the kernel is `StreamedInt8Kernel`;
a float32 int8 shard's decode steps multiply those int8 rows in `cpu_decode`'s layer halves, other steps in the
eager layers.

Bringing a layer in: `madvise(MADV_POPULATE_READ)` on its byte ranges reads them from disk into the page cache if
they are not there and maps them, so the products take no page faults; or in copy mode the layer is copied into
the free buffer. After a layer ran its pages are dropped from the process (`MADV_DONTNEED`: a file-backed page
leaves the process's RSS and stays in the page cache, so a hot step reads memory, not disk). So at most two
streamed layers are in the process at a time: the one computing and the next one.

Huge pages: mapping and dropping 4 KiB at a time was what a hot step paid for streaming (SmolLM2, half its weights
streamed: 0.77 ms to populate a 14 MiB layer and 0.15-0.27 ms to drop it, 26 layers a step, against ~1.3 ms for
the step's own work on the layer). Where the page cache holds the file in huge folios, one entry maps 2 MiB and
both take ~0.07 ms. The mapping is advised MADV_HUGEPAGE and, at load, `LayerStreamer.settle` has the page cache
read the streamed layers back in huge folios when they map small (`settle` says how), then times the reads of up
to `PROBE_BYTES` of them: the bound, the page-cache read rate the streamer's own reads reach.

Who reads: where the layers map in huge pages, the compute thread maps each layer as it comes (`inline`: 0.07 ms
is less than handing the work to a thread and back, and a cold file was read fastest through the kernel's own
readahead that way); otherwise a reader thread brings the next streamed layer in while layer i computes
(cyclically: after the last one, the first one for the next step).

What the budget counts (bytes, per worker): the shard's weights in memory, nothing else (not the KV cache, the
activations, or torch's own runtime, which `--memory-budget` users add on top): the resident parameters as loaded
(numel x serving dtype size) plus the streamed layers' working set, which is, zero copy, the mapped pages of the
two largest streamed layers, each read counted from its first to its last byte rounded out to `OffloadPlan.map_unit`
(a huge page, 2 MiB, where the plan fits with them; else 64 KiB, as the kernel maps up to 64 KiB around each page
fault, `fault_around_bytes`; a row-parallel slice at tp > 1 therefore counts its whole rows), and in copy mode the
two buffers plus the mapped pages of the largest single read being copied.
Layers are kept resident from the first one on while resident bytes plus that working set fit. A budget that
does not fit even with every layer streamed is refused, naming both numbers.

`bytes_streamed(model)` counts the weight bytes made available by streaming (each streamed layer's products'
numel x serving dtype size, once per forward): per step exactly `OffloadPlan.streamed_bytes_per_step`.
`stats(model)` adds the reads' bytes and seconds (the achieved rate), the compute thread's waits and the bound.

A streamed shard reads its checkpoint every step: the files must stay as they are while it serves (a file
replaced by renaming over it is fine, the old one stays mapped; one truncated in place is not).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import DType, Quantization
from shardmesh.core.layout import ShardSpec
from shardmesh.core.units import format_bytes
from shardmesh.engine import cpu_kernels, host_offload
from shardmesh.engine.int8_copy import ensure_copy, int8_reads, scale_name
from shardmesh.engine.linear import (
    LinearKernel,
    LinearProduct,
    dequantize,
    int8_products,
    layer_products,
    row_major_int8,
)
from shardmesh.engine.model import Transformer
from shardmesh.models.checkpoint import Checkpoint, TensorRead

PAGE = mmap.PAGESIZE
FAULT_AROUND = 64 * 1024  # Linux maps up to this much around a read fault on a file mapping (fault_around_bytes)
MADV_WILLNEED, MADV_DONTNEED, MADV_HUGEPAGE, MADV_POPULATE_READ = 3, 4, 14, 22  # <sys/mman.h>
THP = Path("/sys/kernel/mm/transparent_hugepage")
# A read this many times slower than the bound found the file out of the page cache: hot reads of SmolLM2 layers
# took 0.9x the bound's time at the median, 4.7x at p90 on a busy machine (p99 60x: a stall, which costs one
# prefetch on the reader thread), reads from its disk 100x and more.
COLD = 20
PROBE_BYTES = 256 * 2**20  # the load-time probe of the read rate times at most this many bytes of streamed layers
PROBE_PASSES = 3
CHECKPOINT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8}


@dataclass(frozen=True)
class OffloadPlan:
    """Which layers of a shard stay resident and which stream, and the bytes each side takes."""

    budget: int
    resident_layers: range  # leading layers, every weight loaded
    streamed_layers: range  # trailing layers whose product weights stream
    resident_bytes: int  # parameters loaded into memory, numel x serving dtype size
    working_set_bytes: int  # streamed weights in the process at once (mapped pages, or the copy buffers)
    streamed_bytes_per_step: int  # product weights made available by streaming in one forward
    zero_copy: bool
    map_unit: int = FAULT_AROUND  # each mapped read counts its bytes rounded out to this (`map_unit()`)

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.working_set_bytes

    def describe(self) -> str:
        mode = "zero-copy" if self.zero_copy else "copy"
        resident, streamed = self.resident_layers, self.streamed_layers
        return (f"layers [{resident.start}, {resident.stop}) resident, [{streamed.start}, {streamed.stop}) streamed "
                f"({mode}): {format_bytes(self.resident_bytes)} resident + {format_bytes(self.working_set_bytes)} "
                f"streaming of a {format_bytes(self.budget)} budget, {format_bytes(self.streamed_bytes_per_step)} "
                "per step")  # fmt: skip


def layer_index(name: str) -> int | None:
    """The global decoder layer a parameter belongs to (`model.layers.7.mlp...` -> 7), None outside the layers."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else None


@dataclass(frozen=True)
class _Located:
    """Where a read's tensor lies: its file, the byte offset of its data there, its checkpoint dtype."""

    file: Path
    offset: int
    dtype: torch.dtype | None  # None: a dtype that cannot be mapped as a float tensor


def _locate(ckpt: Checkpoint, reads: Iterable[TensorRead]) -> dict[str, _Located]:
    """Where each read's tensor lies, from the headers `Checkpoint` validated."""
    return {r.source: _Located(i.file, i.offset, CHECKPOINT_DTYPES.get(i.dtype))
            for r in reads for i in (ckpt.info(r.source),)}  # fmt: skip


def _byte_range(r: TensorRead, loc: _Located) -> tuple[int, int]:
    """[first, last + 1) byte of the file that read `r` touches (its tensor is row-major, slices step 1)."""
    assert loc.dtype is not None
    index = (r.index or ()) + (slice(None),) * (len(r.full_shape) - len(r.index or ()))
    stride, first, last = 1, 0, 0
    for dim, s in zip(reversed(r.full_shape), reversed(index), strict=True):
        start, stop, _ = s.indices(dim)
        first, last = first + start * stride, last + (stop - 1) * stride
        stride *= dim
    size = loc.dtype.itemsize
    return loc.offset + first * size, loc.offset + (last + 1) * size


def _align(begin: int, end: int, unit: int) -> tuple[int, int]:
    return begin // unit * unit, -(-end // unit) * unit


def huge_page_size() -> int:
    """Bytes of a huge (PMD) mapping of a file's page cache, 0 where transparent huge pages are off ("never").

    Where the page cache holds a file in huge folios (ext4 and xfs on recent kernels, read in through a mapping
    advised MADV_HUGEPAGE), one page-table entry maps 2 MiB: populating and dropping a streamed SmolLM2 layer
    (14 MiB) took 0.011 + 0.005 ms against 0.73 + 0.15-0.27 ms in 4 KiB pages (Linux 6.18, measured here)."""
    try:
        if "[never]" in (THP / "enabled").read_text():
            return 0
        return int((THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0


def map_unit() -> int:
    """What one fault (or one populated entry) can map around a byte of a file mapping: a huge page where the
    kernel may map one, else the fault-around window."""
    return max(huge_page_size(), FAULT_AROUND)


def _mapped_bytes(spans: list[tuple[Path, int, int]], unit: int) -> int:
    """What reading these byte ranges (file, begin, end) through a mapping can bring into the process: their
    union, each rounded out to `unit` (an upper bound; a column slice counts its whole rows)."""
    total, last = 0, (None, 0)
    for path, begin, end in sorted((p, *_align(b, e, unit)) for p, b, e in spans):
        at = max(begin, last[1]) if path == last[0] else begin
        total += max(0, end - at)
        last = (path, max(end, last[1]) if path == last[0] else end)
    return total


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [begin, end) runs joined."""
    out: list[tuple[int, int]] = []
    for begin, end in sorted(runs):
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((begin, end))
    return out


def _coalesce(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """(address, length) ranges joined where less than `gap` bytes lie between them."""
    runs = _merge([(a, a + n + gap) for a, n in ranges])  # widened by the gap, so that near ones touch
    return [(begin, end - gap - begin) for begin, end in runs]


def _two_largest(values: list[int]) -> int:
    return sum(sorted(values, reverse=True)[:2])


@dataclass(frozen=True)
class Int8Streams:
    """An int8 shard's side of a plan: the products it holds in int8 (`linear.int8_products`, resident ones
    quantized at load) and the int8 copy its streamed layers map (`int8_copy`; None on CUDA, whose streamed layers
    are quantized as they are pinned, `host_offload`)."""

    products: set[str]
    copy: Checkpoint | None

    def held_bytes(self, r: TensorRead) -> int:
        """Bytes a product read holds in int8, values and its groups' scales (`Quantization.weight_bytes`)."""
        rows, cols = r.shape
        return Quantization.INT8.weight_bytes(rows, cols, DType.FLOAT32)


def _streamed_reads(r: TensorRead, int8: Int8Streams | None) -> tuple[TensorRead, ...]:
    """What streaming product read `r` maps: itself in the checkpoint, or its int8 weight and scales in the copy."""
    return int8_reads(r) if int8 is not None else (r,)


def plan_offload(
    ckpt: Checkpoint,
    model: Transformer,
    reads: list[TensorRead],
    dtype: torch.dtype,
    budget: int,
    device: torch.device | str = "cpu",
    unit: int | None = None,
    int8: Int8Streams | None = None,
) -> OffloadPlan:
    """The split of a shard (`loader.meta_shard`'s model and reads) under `budget` bytes: as many leading layers
    resident as fit next to the working set of the streamed ones (the module docstring says what counts).
    `unit`: what a mapped read rounds out to; by default huge pages (`map_unit()`) where the plan fits with them,
    else the fault-around window: huge pages make the hot path cheaper than any resident layer they may cost.
    `int8`: the shard holds its products in int8 and streams them from the int8 copy.
    Raises ValueError naming the bytes needed and given when even streaming every layer does not fit."""
    if unit is not None:
        return _plan(ckpt, model, reads, dtype, budget, device, unit, int8)
    try:
        return _plan(ckpt, model, reads, dtype, budget, device, map_unit(), int8)
    except BudgetError:
        if map_unit() == FAULT_AROUND:
            raise
        return _plan(ckpt, model, reads, dtype, budget, device, FAULT_AROUND, int8)


def _plan(
    ckpt: Checkpoint, model: Transformer, reads: list[TensorRead], dtype: torch.dtype, budget: int,
    device: torch.device | str, unit: int, int8: Int8Streams | None,
) -> OffloadPlan:  # fmt: skip
    if torch.device(device).type == "cuda":
        return _plan_host(model, reads, dtype, budget, int8)
    if torch.device(device).type != "cpu":
        raise ValueError(f"memory budget: offload streams weights on cpu or cuda, not on {device}")
    layers = model.layer_range
    streams = layer_products(model)
    mapped_reads = [m for r in reads if r.target in streams for m in _streamed_reads(r, int8)]
    located = _locate(int8.copy or ckpt if int8 is not None else ckpt, mapped_reads)
    # The int8 copy is mapped as it lies (int8 values, float16 scales); a float checkpoint when it is the serving dtype
    zero_copy = int8 is not None or all(
        located[r.source].dtype == dtype and located[r.source].offset % dtype.itemsize == 0 for r in mapped_reads
    )
    base, kept, streamed = _layer_bytes(model, reads, dtype, int8)
    spans: dict[int, list[tuple[Path, int, int]]] = defaultdict(list)  # per layer: the bytes its weights map
    largest_read = 0
    for r in reads:
        if r.target in streams:
            for m in _streamed_reads(r, int8):
                loc = located[m.source]
                if loc.dtype is None:
                    raise ValueError(f"memory budget: tensor '{m.source}' cannot be streamed (not a float dtype)")
                spans[layer_index(r.target) or 0].append((loc.file, *_byte_range(m, loc)))
                largest_read = max(largest_read, _mapped_bytes([spans[layer_index(r.target) or 0][-1]], unit))
    mapped = {i: _mapped_bytes(spans[i], unit) for i in layers}

    def working(streaming: range) -> int:
        if zero_copy:
            return _two_largest([mapped[i] for i in streaming])
        copies = min(2, len(streaming)) * max((streamed[i] for i in streaming), default=0)
        return copies + (largest_read if streaming else 0)

    return _split(model, dtype, budget, int8, base, kept, streamed, working, zero_copy, unit)


def _plan_host(model: Transformer, reads: list[TensorRead], dtype: torch.dtype, budget: int,
               int8: Int8Streams | None) -> OffloadPlan:  # fmt: skip
    """A CUDA shard's split (`host_offload`): the working set is the device ring, two buffers of the largest
    streamed layer as packed; the streamed layers' pinned host copies are host memory, outside the budget."""
    base, kept, streamed = _layer_bytes(model, reads, dtype, int8)
    streams = layer_products(model)
    by_layer: dict[int, list[TensorRead]] = defaultdict(list)
    for r in reads:
        if r.target in streams:
            by_layer[layer_index(r.target) or 0].append(r)
    products = int8.products if int8 is not None else set()
    packed = {i: host_offload.packed_bytes(rs, dtype, products) for i, rs in by_layer.items()}

    def working(streaming: range) -> int:
        return min(2, len(streaming)) * max((packed[i] for i in streaming), default=0)

    return _split(model, dtype, budget, int8, base, kept, streamed, working, False, host_offload.ALIGN)


def _layer_bytes(
    model: Transformer, reads: list[TensorRead], dtype: torch.dtype, int8: Int8Streams | None
) -> tuple[int, dict[int, int], dict[int, int]]:
    """Bytes held outside the decoder layers; per layer, bytes resident whether it streams or not (norms, biases);
    per layer, bytes of its products' weights (int8: values and scales)."""
    streams = layer_products(model)
    base = 0
    kept: dict[int, int] = defaultdict(int)
    streamed: dict[int, int] = defaultdict(int)
    for r in reads:
        i = layer_index(r.target)
        size = int8.held_bytes(r) if int8 is not None and r.target in int8.products else r.numel * dtype.itemsize
        if i is None:
            base += size
        elif r.target in streams:
            streamed[i] += size
        else:
            kept[i] += size
    return base, kept, streamed


def _split(
    model: Transformer, dtype: torch.dtype, budget: int, int8: Int8Streams | None, base: int, kept: dict[int, int],
    streamed: dict[int, int], working: Callable[[range], int], zero_copy: bool, unit: int,
) -> OffloadPlan:  # fmt: skip
    """As many leading layers resident as fit next to `working(streamed layers)`, else BudgetError."""
    layers = model.layer_range
    need = 0
    for resident in range(len(layers), -1, -1):
        split = layers.start + resident
        streaming = range(split, layers.stop)
        bytes_resident = base + sum(kept[i] + (streamed[i] if i < split else 0) for i in layers)
        need = bytes_resident + working(streaming)
        if need <= budget:
            return OffloadPlan(budget, range(layers.start, split), streaming, bytes_resident, need - bytes_resident,
                               sum(streamed[i] for i in streaming), zero_copy, unit)  # fmt: skip
    held = str(dtype).removeprefix("torch.") + (" with int8 products" if int8 is not None else "")
    raise BudgetError(
        need,
        f"memory budget {budget} B ({format_bytes(budget)}) is too small for layers [{layers.start}, {layers.stop}) "
        f"in {held}: it needs at least {need} B ({format_bytes(need)}) with every decoder layer streamed",
    )


class BudgetError(ValueError):
    """A memory budget too small for a shard even with every layer streamed; `needed` is the least that fits."""

    def __init__(self, needed: int, message: str) -> None:
        super().__init__(message)
        self.needed = needed


def int8_streams(
    ckpt: Checkpoint, model: Transformer, reads: list[TensorRead], dtype: torch.dtype, progress: bool = True,
    device: torch.device | str = "cpu",
) -> Int8Streams:  # fmt: skip
    """An int8 shard's `Int8Streams`: the int8 copy of its layers' products, written now where the cache lacks it
    (`int8_copy.ensure_copy`: every layer of the shard, for the plan to place any of them). On CUDA none: its
    streamed layers are quantized as they are pinned (`host_offload`)."""
    if torch.device(device).type == "cuda":
        return Int8Streams(int8_products(model), None)
    streams = layer_products(model)
    sources: dict[int, list[str]] = defaultdict(list)
    for r in reads:
        if r.target in streams and r.source not in sources[layer_index(r.target) or 0]:
            int8_reads(r)  # a slice of inputs the copy's groups do not start at is refused here, before any writing
            sources[layer_index(r.target) or 0].append(r.source)
    return Int8Streams(int8_products(model), ensure_copy(ckpt, dict(sources), dtype, progress))


def check_budget(
    model_dir: str | Path, cfg: ModelConfig, specs: list[ShardSpec], dtype: torch.dtype, budget: int,
    devices: list[str] | str = "cpu", quantization: Quantization = Quantization.NONE,
) -> None:  # fmt: skip
    """`plan_offload` for every shard of a mesh from the checkpoint's headers, before any process starts, each on its
    own device (`devices`: one per spec, or one for all; with int8 on a CPU, from the int8 copy of its layers,
    written now if the cache lacks it); a refusal names the shard that needs the most."""
    from shardmesh.engine.groups import UnboundGroup
    from shardmesh.engine.loader import meta_shard  # here: the loader imports this module

    ckpt = Checkpoint(model_dir)
    refused: list[BudgetError] = []
    for spec, device in zip(specs, [devices] * len(specs) if isinstance(devices, str) else devices, strict=True):
        model, reads = meta_shard(cfg, spec, UnboundGroup(spec.tp_rank, spec.tp_size), None)
        int8 = int8_streams(ckpt, model, reads, dtype, device=device) if quantization is Quantization.INT8 else None
        try:
            plan_offload(ckpt, model, reads, dtype, budget, device, int8=int8)
        except BudgetError as e:
            refused.append(e)
    if refused:
        raise max(refused, key=lambda e: e.needed)  # the shard that needs the most: its number fits them all


class StreamedKernel(LinearKernel):
    """F.linear by weights the streamer hands over for one forward (`blocks`: the product's rows, one tensor per
    stacked block when they are mapped apart, one when copied together); the module's own `weight` is None."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.blocks: list[Tensor] | None = None
        self.scales: list[Tensor] | None = None  # `StreamedInt8Kernel`: each block's groups' scales

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert self.blocks is not None, "a streamed product's weights exist only while its layer runs"
        return torch.cat(self.blocks)

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None, scale: Tensor | None = None) -> Tensor:
        blocks = self.blocks
        assert blocks is not None, "a streamed product's weights exist only while its layer runs"
        if len(blocks) == 1:
            return self._block(x, 0, bias)
        outs, row = [], 0
        for i, w in enumerate(blocks):  # each block with its rows of the bias, as the stacked product would add them
            outs.append(self._block(x, i, bias[row : row + w.shape[0]] if bias is not None else None))
            row += w.shape[0]
        return torch.cat(outs, dim=-1)

    def _block(self, x: Tensor, i: int, bias: Tensor | None) -> Tensor:
        assert self.blocks is not None
        return _product(x, self.blocks[i], bias)


class StreamedInt8Kernel(StreamedKernel):
    """The streamed products of an int8 shard: int8 blocks mapped from the int8 copy (`int8_copy`) with their groups'
    scales (`scales`), each multiplied as it lies, row-major, by the int8 kernels that read that layout:
    `Int8CpuKernel` for float32 (`int8_cpu.linear` on decode rows, reading a row-parallel slice's strided rows in
    place), else `Int8DequantKernel`. (`cpu_decode`'s layer halves take the blocks and scales themselves, and sum
    as `int8_cpu.linear` does.)"""

    quantized = True

    def dense(self, weight: Tensor, scale: Tensor | None = None) -> Tensor:
        assert self.blocks is not None and self.scales is not None, "weights exist only while the layer runs"
        return torch.cat([dequantize(w, s) for w, s in zip(self.blocks, self.scales, strict=True)])

    def _block(self, x: Tensor, i: int, bias: Tensor | None) -> Tensor:
        assert self.blocks is not None and self.scales is not None
        return row_major_int8(x.device, x.dtype)(x, self.blocks[i], bias, self.scales[i])


ROWS_LINEAR_MAX = 8  # rows of x up to which `cpu_kernels.rows_linear` multiplies streamed weights; a prompt's GEMM


def _product(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x times a mapped (or copied) weight as the checkpoint lays it out, row-major: for decode rows of float32 on a
    CPU `cpu_kernels.rows_linear` (SmolLM2's products, one row, one core: 37 against F.linear's 16 GB/s), else
    F.linear."""
    rows = x.numel() // max(1, x.shape[-1])
    if (rows <= ROWS_LINEAR_MAX and x.dtype == w.dtype == torch.float32 and w.device.type == "cpu"
            and w.stride(-1) == 1 and cpu_kernels.available()):  # fmt: skip
        return cpu_kernels.rows_linear(x, w, bias)
    return F.linear(x, w, bias)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _madvise(ranges: list[tuple[int, int]], advice: int) -> bool:
    """madvise each (address, length); through ctypes, which lets go of the GIL while the kernel works."""
    return all(_libc.madvise(addr, length, advice) == 0 for addr, length in ranges)


@dataclass
class _Layer:
    """One streamed layer: its products' kernels and, per product path, the mapped source of each read."""

    kernels: dict[str, StreamedKernel]
    sources: dict[str, list[Tensor]]  # mapped (zero copy: what the kernels multiply by)
    ranges: list[tuple[int, int]]  # page-aligned (address, length) of its bytes, for populate
    drops: list[tuple[int, int]]  # `OffloadPlan.map_unit`-aligned ranges, for dropping what faults mapped
    files: list[tuple[Path, int, int]]  # (file, offset, length) of `drops` in their files, for the page cache
    read_drops: list[list[tuple[int, int]]] = field(default_factory=list)  # copy mode: per product, after copying
    nbytes: int = 0  # product weight bytes, numel x serving dtype size


@dataclass
class StreamStats:
    """What a streamer did since it was built (counters) and what it measured at load (the bound)."""

    streamed_bytes: int  # product weights handed to the products: per forward exactly the plan's bytes per step
    read_bytes: int  # weight bytes the reads brought in (populated, or copied into a buffer)
    read_seconds: float  # time those reads took, on whichever thread ran them
    wait_seconds: float  # time the compute thread waited for reads: a prefetch not done yet, or a read it ran
    bound_bytes_per_second: float  # the same reads timed at load with the checkpoint in the page cache
    planned_bytes_per_step: int
    huge_pages: bool  # the streamed layers are mapped in huge pages (`huge_page_size`)


def _pmd_mapped() -> int:
    """Bytes of file pages this process maps in huge (PMD) entries."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("FilePmdMapped:"):
            return int(line.split()[1]) * 1024
    return 0


class LayerStreamer:
    """The streamed layers of one shard: maps their files, hands each layer's weights to its products for one
    forward, prefetches the next one on a reader thread and drops the last one's pages (module docstring)."""

    def __init__(self, plan: OffloadPlan, dtype: torch.dtype, buffer_numel: int) -> None:
        self.plan, self.dtype = plan, dtype
        self.bytes_streamed = 0
        self.read_bytes, self.read_seconds, self.wait_seconds = 0, 0.0, 0.0
        self.bound_bytes_per_second, self.huge_pages = 0.0, False
        # Map each layer on the compute thread instead of prefetching it on the reader while reads find the file
        # in the page cache: chosen by `settle` where the layers map in huge pages. Hot, that is 0.07 ms a
        # SmolLM2 layer, less than handing work to a thread and back (1.10-1.12x the resident step against
        # 1.11-1.20x, bench/offload.py). A read that found the file out of the page cache (`cold`) has the reader
        # prefetch the next layer, as long as reads stay cold, so the disk reads while a layer computes (cold,
        # the reader was ahead of mapping inline in 18 and 16 of 24 steps with a core to spare, behind in 9 of
        # 24 on a busier machine; MADV_WILLNEED on the next layers was slower than both).
        self.inline, self.cold = False, False
        self.layers: dict[int, _Layer] = {}
        self._maps: dict[Path, tuple[mmap.mmap, int]] = {}  # file -> (mapping, its address)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="shardmesh-offload")
        self._pending: tuple[int, int, Future[None]] | None = None  # (layer, buffer slot, fetch in flight)
        # Copy mode: two buffers, each the size of the largest streamed layer (zero copy: none).
        self._buffers = [torch.empty(0 if plan.zero_copy else buffer_numel, dtype=dtype) for _ in range(2)]
        self._copied: dict[int, list[dict[str, Tensor]]] = {}  # copy mode: per layer, per slot, product -> view
        self._populate = MADV_POPULATE_READ

    def _map(self, path: Path) -> tuple[mmap.mmap, int]:
        if path not in self._maps:
            with path.open("rb") as f:  # a private mapping: writable for `torch.frombuffer`, never written
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            addr = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
            if self.plan.map_unit > FAULT_AROUND:  # a huge page may map it (`map_unit`): the plan counted them
                _madvise([(addr, len(mm))], MADV_HUGEPAGE)
            self._maps[path] = (mm, addr)
        return self._maps[path]

    def add(self, index: int, reads: list[TensorRead], located: dict[str, _Located], kernels: dict[str, StreamedKernel],
            shapes: dict[str, tuple[int, ...]]) -> None:  # fmt: skip
        """Register streamed layer `index`: `reads` fill the products' weights, whose kernels and (local) shapes
        are keyed by parameter path."""
        sources: dict[str, list[Tensor]] = defaultdict(list)
        ranges, drops, files, read_drops = [], [], [], defaultdict(list)
        for r in reads:
            loc = located[r.source]
            assert loc.dtype is not None
            mm, addr = self._map(loc.file)
            whole = torch.frombuffer(mm, dtype=loc.dtype, count=math.prod(r.full_shape), offset=loc.offset)
            whole = whole.view(r.full_shape)
            sources[r.target].append(whole[r.index] if r.index is not None else whole)
            begin, end = _byte_range(r, loc)
            page = _align(begin, end, PAGE)
            ranges.append((addr + page[0], page[1] - page[0]))
            wide = _align(begin, end, self.plan.map_unit)
            wide = (wide[0], min(wide[1], len(mm)))
            drops.append((addr + wide[0], wide[1] - wide[0]))
            files.append((loc.file, wide[0], wide[1] - wide[0]))
            read_drops[r.target].append(drops[-1])
        # bytes as the products get them: as mapped (zero copy: the serving dtype, or int8 values and their scales)
        nbytes = sum(r.numel * (located[r.source].dtype.itemsize if self.plan.zero_copy else self.dtype.itemsize)
                     for r in reads)  # fmt: skip
        # One madvise per run of the layer's tensors rather than one per tensor (7 -> 1 for a Llama layer, whose
        # tensors lie together in the file but for its norms, a few KiB that rounding to the unit covers anyway).
        ranges, drops = _coalesce(ranges, self.plan.map_unit), _coalesce(drops, self.plan.map_unit)
        self.layers[index] = _Layer(kernels, dict(sources), ranges, drops, files,
                                    [read_drops[t] for t in sources], nbytes)  # fmt: skip
        if not self.plan.zero_copy:
            self._copied[index] = [self._buffer_views(slot, shapes, sources) for slot in range(2)]

    def _buffer_views(self, slot: int, shapes: dict[str, tuple[int, ...]], sources: dict[str, Any]) -> dict:
        """Copy mode: each product's weight as a view of buffer `slot`, products back to back."""
        views, at = {}, 0
        for t in sources:
            n = torch.Size(shapes[t]).numel()
            views[t] = self._buffers[slot][at : at + n].view(shapes[t])
            at += n
        return views

    def settle(self) -> None:
        """At load: have the page cache hold the streamed layers in huge folios where it can, and measure the
        bound (`StreamStats.bound_bytes_per_second`) on up to `PROBE_BYTES` of them.

        A file read by `read()` or written by its maker sits in the page cache in small folios, which a mapping
        maps 4 KiB at a time however it is advised. Read back through a mapping in long sequential runs, it comes
        in huge folios (readahead grows its folios; populating layer by layer, out of file order, did not). So
        when a streamed layer does not map huge, the streamed layers' clean pages are dropped from the page cache
        (POSIX_FADV_DONTNEED: pages another process maps stay) and read back here once, from the disk, in file
        order: every later step maps them at one entry per 2 MiB. The timed pass that follows runs with them in
        the page cache: the hot read rate."""
        if not self.layers:
            return
        huge = self.plan.zero_copy and self.plan.map_unit > FAULT_AROUND
        if huge and not all(self._maps_huge(layer) for layer in self.layers.values()):
            self._refill()
        self.huge_pages = self.inline = huge and all(self._maps_huge(layer) for layer in self.layers.values())
        self._probe_pass()  # the probe times page-cache reads: bring its layers in first
        passes = [self._probe_pass() for _ in range(PROBE_PASSES)]  # the best of a few: a busy machine stalls some
        self.bound_bytes_per_second = max(nbytes / seconds if seconds > 0 else 0.0 for seconds, nbytes in passes)

    def _maps_huge(self, layer: _Layer) -> bool:
        """Whether populating `layer` maps most of its bytes in huge entries."""
        before = _pmd_mapped()
        _madvise(layer.ranges, self._populate or MADV_WILLNEED)
        mapped = _pmd_mapped() - before
        _madvise(layer.drops, MADV_DONTNEED)
        return mapped >= layer.nbytes // 2

    def _refill(self) -> None:
        """Drop the streamed layers' pages from the page cache and read them back through the mapping, file by
        file in ascending runs, at most the working set mapped at a time (the budget holds while loading)."""
        spans: dict[Path, list[tuple[int, int]]] = defaultdict(list)  # file -> [begin, end) in it
        for layer in self.layers.values():
            for path, offset, length in layer.files:
                spans[path].append((offset, offset + length))
        chunk = max(self.plan.map_unit, self.plan.working_set_bytes // self.plan.map_unit * self.plan.map_unit)
        for path, runs in spans.items():
            address = self._maps[path][1]
            with path.open("rb") as f:
                for begin, end in _merge(runs):
                    os.posix_fadvise(f.fileno(), begin, end - begin, os.POSIX_FADV_DONTNEED)
                    for at in range(begin, end, chunk):
                        piece = [(address + at, min(chunk, end - at))]
                        _madvise(piece, self._populate or MADV_WILLNEED)
                        _madvise(piece, MADV_DONTNEED)

    def _probe_pass(self) -> tuple[float, int]:
        """Read streamed layers, in order, up to `PROBE_BYTES` (at least one), each dropped again after: the
        seconds the reads took and their bytes (not counted in the stats)."""
        seconds, nbytes = 0.0, 0
        for index in self.plan.streamed_layers:
            if nbytes >= PROBE_BYTES:
                break
            t0 = time.perf_counter()
            self._read(index, 0)
            seconds += time.perf_counter() - t0
            nbytes += self.layers[index].nbytes
            if self.plan.zero_copy:
                _madvise(self.layers[index].drops, MADV_DONTNEED)
        return seconds, nbytes

    def _next(self, index: int) -> int:
        order = self.plan.streamed_layers
        return order[(order.index(index) + 1) % len(order)]

    def _fetch(self, index: int, slot: int) -> None:
        """`_read`, timed into the stats; notes whether it found the file out of the page cache (`COLD`)."""
        t0 = time.perf_counter()
        self._read(index, slot)
        took = time.perf_counter() - t0
        self.read_seconds += took  # one reader at a time: the reader thread, or the caller
        self.read_bytes += self.layers[index].nbytes
        self.cold = took * self.bound_bytes_per_second > COLD * self.layers[index].nbytes

    def _read(self, index: int, slot: int) -> None:
        """Bring layer `index` in: populate its mapped pages (zero copy), or copy-convert it into buffer `slot`."""
        layer = self.layers[index]
        if self.plan.zero_copy:
            if self._populate and not _madvise(layer.ranges, self._populate):
                self._populate = 0  # an older kernel: ask for readahead, and let the compute thread fault them in
            if not self._populate:
                _madvise(layer.ranges, MADV_WILLNEED)
            return
        views = self._copied[index][slot]
        for (target, sources), drops in zip(layer.sources.items(), layer.read_drops, strict=True):
            rows = 0
            for src in sources:
                views[target][rows : rows + src.shape[0]].copy_(src)
                rows += src.shape[0]
            _madvise(drops, MADV_DONTNEED)  # the copy holds them now

    def acquire(self, index: int) -> int:
        """Before layer `index` runs: have its weights in (`inline`: map them now; else wait for the reader's
        prefetch), give its products their weights, and start bringing the next streamed layer in. Returns the
        slot they are in: a layer's products get the same tensors whenever it is in the same slot (zero copy,
        the mapped ones whatever the slot; in copy mode, views of that slot's buffer)."""
        t0 = time.perf_counter()
        slot = self._wait_for(index)
        self.wait_seconds += time.perf_counter() - t0
        layer = self.layers[index]
        for path, kernel in layer.kernels.items():
            if self.plan.zero_copy:
                kernel.blocks = layer.sources[path]
                kernel.scales = layer.sources.get(scale_name(path))  # an int8 product's (`StreamedInt8Kernel`)
            else:
                kernel.blocks = [self._copied[index][slot][path]]
        self.bytes_streamed += layer.nbytes
        following = self._next(index)
        if self.inline and not self.cold:
            return slot  # nothing in flight: the next acquire maps its layer itself
        if following != index:
            self._pending = (following, 1 - slot, self._reader.submit(self._fetch, following, 1 - slot))
        else:  # the only streamed layer: it stays in (its pages, or its buffer) from step to step
            self._pending = (index, slot, _done())
        return slot

    def _wait_for(self, index: int) -> int:
        """The reader's prefetch of layer `index` done (fetched now if another one was prefetched, or `inline`):
        its slot."""
        if self._pending is None:
            self._fetch(index, 0)
            return 0
        pending, pending_slot, future = self._pending
        self._pending = None
        future.result()
        if pending == index:
            return pending_slot
        self._fetch(index, 1 - pending_slot)  # out of the usual order: into the other buffer
        return 1 - pending_slot

    def release(self, index: int) -> None:
        """After layer `index` ran: its products lose their weights, and its mapped pages leave the process."""
        layer = self.layers[index]
        for kernel in layer.kernels.values():
            kernel.blocks = kernel.scales = None
        if self.plan.zero_copy and self._next(index) != index:
            _madvise(layer.drops, MADV_DONTNEED)

    def stats(self) -> StreamStats:
        return StreamStats(self.bytes_streamed, self.read_bytes, self.read_seconds, self.wait_seconds,
                           self.bound_bytes_per_second, self.plan.streamed_bytes_per_step,
                           self.huge_pages)  # fmt: skip


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


def streamer_of(model: Transformer) -> LayerStreamer | None:
    """The streamer of a shard built with a memory budget that streams layers (None: all resident)."""
    return model.streamer


def bytes_streamed(model: Transformer) -> int:
    """Weight bytes made available by streaming since the shard was built (0 when nothing streams)."""
    return model.streamer.bytes_streamed if model.streamer is not None else 0


def stats(model: Transformer) -> StreamStats | None:
    """What the shard's streamer did and measured (None: nothing streams)."""
    return model.streamer.stats() if model.streamer is not None else None


def stream_layers(
    ckpt: Checkpoint, model: Transformer, reads: list[TensorRead], dtype: torch.dtype, device: torch.device | str,
    budget: int, quantization: Quantization = Quantization.NONE, progress: bool = True,
) -> list[TensorRead]:  # fmt: skip
    """Plan the shard under `budget`; when layers must stream, take their products' weights out of the (meta)
    model, give those products a `StreamedKernel` and their layers the hooks that stream them. Returns the reads
    left for the loader to load resident. On a CPU they map the checkpoint (with int8, the int8 copy of its layers,
    `int8_streams`); on CUDA they are packed into pinned host memory and copied in each step (`host_offload`). An
    int8 shard's streamed kernel is a `StreamedInt8Kernel`."""
    cuda = torch.device(device).type == "cuda"
    int8 = int8_streams(ckpt, model, reads, dtype, progress, device) if quantization is Quantization.INT8 else None
    plan = plan_offload(ckpt, model, reads, dtype, budget, device, int8=int8)
    if not plan.streamed_layers:
        return reads
    streams = layer_products(model)
    streamed = [r for r in reads if r.target in streams and layer_index(r.target) in plan.streamed_layers]
    by_layer: dict[int, list[TensorRead]] = defaultdict(list)
    for r in streamed:
        by_layer[layer_index(r.target) or 0].append(r)  # (never None: streamed reads are in layers)
    streamer: LayerStreamer | host_offload.HostLayerStreamer
    if cuda:  # packed into pinned host memory, copied into a device ring each step
        pinned = host_offload.pin_layers(ckpt, model, by_layer, dtype, torch.device(device), quantization, progress)
        host = host_offload.HostLayerStreamer(plan, torch.device(device), max(p.numel() for p, _ in pinned.values()))
        first = model.model.layers[str(model.layer_range.start)]
        first.register_forward_pre_hook(lambda _m, _a: host.begin())  # before a streamed first layer's own hook
        streamer = host
        name = "streamed-pinned"
    else:  # mapped from the checkpoint (or the int8 copy) where it lies
        mapped = {i: [m for r in rs for m in _streamed_reads(r, int8)] for i, rs in by_layer.items()}
        located = _locate(int8.copy or ckpt if int8 is not None else ckpt, [m for ms in mapped.values() for m in ms])
        streamer = LayerStreamer(plan, dtype, max(sum(r.numel for r in rs) for rs in by_layer.values()))
        name = "streamed-int8" if int8 is not None else "streamed" if plan.zero_copy else "streamed-copy"
    kind = StreamedInt8Kernel if int8 is not None else StreamedKernel
    for index in plan.streamed_layers:
        kernels, shapes = {}, {}
        for r in by_layer[index]:
            if r.target in kernels:
                continue
            module = model.get_submodule(r.target.removesuffix(".weight"))
            assert isinstance(module, LinearProduct)
            shapes[r.target] = tuple(module.weight.shape)
            module.weight = None  # type: ignore[assignment]  # no parameter: the streamer hands weights over
            module.kernel = kernels[r.target] = kind(name)
        if isinstance(streamer, LayerStreamer):
            streamer.add(index, mapped[index], located, kernels, shapes)
        else:
            streamer.add(index, *pinned[index], kernels)
        layer = model.model.layers[str(index)]
        layer.register_forward_pre_hook(_acquire_hook(streamer, index))
        layer.register_forward_hook(lambda _m, _a, _o, i=index: streamer.release(i), always_call=True)
    streamer.settle()
    model.streamer = streamer
    targets = {r.target for r in streamed}
    return [r for r in reads if r.target not in targets]


def _acquire_hook(streamer: LayerStreamer | host_offload.HostLayerStreamer,
                  index: int) -> Callable[[nn.Module, Any], None]:  # fmt: skip
    """A forward pre-hook that acquires layer `index` (and returns None: a value would replace the inputs)."""

    def hook(_module: nn.Module, _inputs: Any) -> None:
        streamer.acquire(index)

    return hook


def is_streamed(module: nn.Module) -> bool:
    """Whether a product's weights stream (the loader leaves its kernel alone)."""
    return isinstance(module, LinearProduct) and isinstance(module.kernel, StreamedKernel)
