"""Offload on a GPU: a CUDA shard larger than its memory budget keeps its leading decoder layers on the device and
streams the others' products in from pinned host memory for every step (`build_shard(..., device="cuda",
memory_budget=N)`), the GPU counterpart of `offload`'s memory-mapped CPU streaming.

What is where. At load each streamed layer's product weights (qkv, o, gate_up, down, this tp rank's slice; with
int8, their int8 values and groups' scales, quantized on the device as they are read) are packed back to back into
one pinned (page-locked) host buffer of their own: one `cudaMemcpyAsync` brings a whole layer in. The device holds
everything else (embedding, head, norms, biases, the resident layers) plus a ring of two device buffers, each the
size of the largest streamed layer: the budget counts the resident parameters and that ring, not the pinned host
copy (which is host memory) nor the KV cache.

How a step streams (DeepSpeed ZeRO-Inference and FlexGen's schedule; HF Accelerate copies each layer in before its
forward, with nothing overlapped). Streamed layer j (its position among the streamed ones) lives in ring slot j % 2.
- When the shard's first layer starts, the copy of streamed layer 0 is enqueued on a side copy stream, so it
  overlaps the resident layers' compute.
- Before streamed layer j runs, the compute stream waits for the copy stream (copies up to j are done), then the
  copy of layer j + 1 is enqueued into the other slot, behind everything the compute stream has queued so far
  (layer j - 1, which read that slot, is among it).
So the copy engine moves layer after layer without waiting for the compute in between, and a step takes the longer
of the copies and the compute. Every copy is joined back to the compute stream within the step, which is what lets
a CUDA graph capture the whole step (`cuda_graph`), copies included: a replay copies the same pinned bytes into the
same slots.

The bound. At load `HostLayerStreamer.settle` times copies of a streamed layer from its pinned buffer into the
ring (the best of a few), the pinned host-to-device rate of this machine's link; `stats` reports it with the bytes
each forward streamed (`bytes_streamed`, exactly the plan's bytes per step) and, for steps that were not captured,
the copies' own time measured with CUDA events (replayed steps count bytes only: a graph replays its copies
without a timer).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from shardmesh.core.dtypes import INT8_GROUP, Quantization
from shardmesh.models.checkpoint import Checkpoint, TensorRead

ALIGN = 256  # each packed tensor starts at a multiple of this many bytes (any dtype's alignment, and cuBLAS's)
PROBE_PASSES = 3


@dataclass(frozen=True)
class _Part:
    """One tensor of a packed layer: a product's weight (`scale`: False) or its int8 groups' scales (True)."""

    target: str
    scale: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the layer's buffer

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def view(self, buffer: Tensor) -> Tensor:
        """This tensor inside `buffer` (a uint8 buffer packed as `layout` lays it out)."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layout(tensors: dict[tuple[str, bool], Tensor]) -> tuple[list[_Part], int]:
    """Where each (target, is_scale) tensor goes in a packed layer, and the layer's bytes."""
    parts, at = [], 0
    for (target, scale), t in tensors.items():
        parts.append(_Part(target, scale, t.dtype, tuple(t.shape), at))
        at += _aligned(t.numel() * t.element_size())
    return parts, at


@dataclass
class _HostLayer:
    pinned: Tensor  # uint8, page-locked: the layer's product weights back to back
    parts: list[_Part]
    kernels: dict[str, Any]  # product path -> its `offload.StreamedKernel`
    nbytes: int  # product weight bytes as multiplied (int8: values and scales), once per forward


class HostLayerStreamer:
    """The streamed layers of one CUDA shard: pinned host copies, a ring of two device buffers, a copy stream, and
    the order of copies and waits that overlaps them with compute (module docstring)."""

    def __init__(self, plan: Any, device: torch.device, ring_bytes: int) -> None:
        self.plan, self.device = plan, device
        self.order = list(plan.streamed_layers)
        self.position = {index: j for j, index in enumerate(self.order)}
        self.copy_stream = torch.cuda.Stream(device)
        self.ring = [torch.empty(ring_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.layers: dict[int, _HostLayer] = {}
        self.bytes_streamed = 0
        self.bound_bytes_per_second = 0.0
        self._copied_through = -1  # the last position whose copy is enqueued in this forward
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # uncaptured copies, not summed yet
        self._read_seconds, self._timed_bytes = 0.0, 0

    def add(self, index: int, pinned: Tensor, parts: list[_Part], kernels: dict[str, Any]) -> None:
        self.layers[index] = _HostLayer(pinned, parts, kernels, sum(p.nbytes for p in parts))

    def settle(self) -> None:
        """Time copies of the first streamed layer into the ring: the pinned host-to-device rate (the bound)."""
        layer = self.layers[self.order[0]]
        rates = []
        for _ in range(PROBE_PASSES + 1):  # the first warms the path up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.copy_stream):
                start.record()
                self.ring[0][: layer.pinned.numel()].copy_(layer.pinned, non_blocking=True)
                end.record()
            end.synchronize()
            rates.append(layer.pinned.numel() / (start.elapsed_time(end) / 1e3))
        self.bound_bytes_per_second = max(rates[1:])

    def begin(self) -> None:
        """At the start of a forward: the first streamed layer's copy starts, under the resident layers' compute."""
        self._copied_through = -1
        self._copy_through(0)

    def _copy_through(self, position: int) -> None:
        """Enqueue the copies of streamed positions up to `position` that are not enqueued yet, each behind all the
        compute queued so far (which includes the last reader of its slot)."""
        compute = torch.cuda.current_stream(self.device)
        while self._copied_through < position:
            j = self._copied_through + 1
            layer = self.layers[self.order[j]]
            self.copy_stream.wait_stream(compute)
            timed = not torch.cuda.is_current_stream_capturing()
            with torch.cuda.stream(self.copy_stream):
                if timed:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                self.ring[j % 2][: layer.pinned.numel()].copy_(layer.pinned, non_blocking=True)
                if timed:
                    end.record()
                    self._timed.append((start, end, layer.pinned.numel()))
                    if len(self._timed) > 64:  # a worker whose metrics nobody reads: keep the pending list short
                        self._fold(wait=False)
            self._copied_through = j

    def acquire(self, index: int) -> int:
        """Before layer `index` runs: the compute stream waits for its copy, its products get their weights (views of
        its slot), and the next streamed layer's copy is enqueued. Returns the slot."""
        j = self.position[index]
        self._copy_through(j)  # a forward that did not start at the shard's first layer
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        layer, slot = self.layers[index], j % 2
        blocks: dict[tuple[str, bool], list[Tensor]] = defaultdict(list)
        for part in layer.parts:
            blocks[(part.target, part.scale)].append(part.view(self.ring[slot]))
        for path, kernel in layer.kernels.items():
            kernel.blocks = blocks[(path, False)]
            kernel.scales = blocks.get((path, True))
        self.bytes_streamed += layer.nbytes
        if j + 1 < len(self.order):
            self._copy_through(j + 1)
        return slot

    def replayed(self) -> None:
        """A captured step replayed (`cuda_graph`): its copies ran again, without the hooks that count them."""
        self.bytes_streamed += self.plan.streamed_bytes_per_step

    def release(self, index: int) -> None:
        """After layer `index` ran: its products lose their weights (the slot is reused two layers on)."""
        for kernel in self.layers[index].kernels.values():
            kernel.blocks = kernel.scales = None

    def _fold(self, wait: bool) -> None:
        """Add the timed copies that are done (`wait`: all of them, waiting for those in flight) to the sums."""
        left = []
        for start, end, nbytes in self._timed:
            if wait or end.query():
                end.synchronize()
                self._read_seconds += start.elapsed_time(end) / 1e3
                self._timed_bytes += nbytes
            else:
                left.append((start, end, nbytes))
        self._timed = left

    @property
    def read_seconds(self) -> float:
        """Seconds the uncaptured copies took on the copy engine (CUDA events); waits for those still in flight."""
        self._fold(wait=True)
        return self._read_seconds

    def stats(self) -> Any:
        from shardmesh.engine.offload import StreamStats  # here: offload imports this module

        seconds = self.read_seconds
        # no wait on the host: the compute stream waits for the copies on the device
        return StreamStats(self.bytes_streamed, self._timed_bytes, seconds, 0.0, self.bound_bytes_per_second,
                           self.plan.streamed_bytes_per_step, False)  # fmt: skip


def packed_bytes(reads: list[TensorRead], dtype: torch.dtype, int8: set[str]) -> int:
    """Bytes of one layer packed as `layout` packs it: each product (its reads stacked) aligned, with int8 products
    (`int8`) as values plus their groups' scales."""
    from shardmesh.engine.reads import target_shapes

    total = 0
    for target, (rows, cols) in target_shapes(reads).items():
        sizes = [rows * cols, rows * -(-cols // INT8_GROUP) * 4] if target in int8 else [rows * cols * dtype.itemsize]
        total += sum(_aligned(n) for n in sizes)
    return total


def pin_layers(
    ckpt: Checkpoint, model: nn.Module, by_layer: dict[int, list[TensorRead]], dtype: torch.dtype,
    device: torch.device, quantization: Quantization, progress: bool,
) -> dict[int, tuple[Tensor, list[_Part]]]:  # fmt: skip
    """Each streamed layer's products read (on the device, one layer at a time; int8 quantized there), then packed
    into a pinned host buffer of its own."""
    from shardmesh.engine.loader import Int8Finish  # here: the loader imports offload, which imports this module
    from shardmesh.engine.reads import read_tensors

    out = {}
    finish = Int8Finish(model) if quantization is Quantization.INT8 else None
    for index, reads in tqdm(by_layer.items(), desc="pinning streamed layers", unit="layer", delay=1.0,
                             disable=not progress):  # fmt: skip
        loaded = read_tensors(ckpt, reads, dtype, device, progress=False, finish=finish)
        tensors: dict[tuple[str, bool], Tensor] = {}
        for target, t in loaded.items():
            tensors[(target, False)] = t
            if finish is not None:
                tensors[(target, True)] = finish.scales.pop(target)
        parts, nbytes = layout(tensors)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        for part in parts:
            part.view(pinned).copy_(tensors[(part.target, part.scale)])
        out[index] = (pinned, parts)
        del loaded, tensors
    return out
