"""Decode steps replayed from CUDA graphs: one launch per step instead of a few hundred.

A decode step is a few rows times every weight of the shard. On a GPU the weights stream at HBM speed (an 8B model
in bfloat16: 16 GB, ~5 ms on an H100), but eager PyTorch launches each of the step's ~30 kernels per layer from
Python, several microseconds of CPU each, and leaves the GPU idle between the small ones (norms, rope, the KV
write). A CUDA graph records the step's kernels once and replays them with one launch.

A graph replays fixed shapes and fixed addresses, so a step is fitted to one:
- rows are padded to a bucket (1, 2, 4, 8, ... up to `max_rows`) by repeating row 0: same input, same slot, same
  position, so a padded row writes row 0's key and value again, the same bytes to the same place, and its output
  is dropped;
- attention gathers each row's slot up to a length bucket (256, 512, ... up to the cache's length) and masks the
  positions past each row's own (`batch.GatheredDecodeRows`), at most twice the keys a step needs;
- inputs, slots and positions are copied into static buffers that every graph reads.
Graphs are captured on first use of a (rows, length) pair and share one memory pool (one graph runs at a time).

Eligible: a CUDA device, the slot KV cache, a step of one-token segments only (decode), logits of each
sequence's last token, a stage without a tensor-parallel group (collectives inside a captured graph need the
process group's capture support: not done yet). Everything else runs eagerly, as does every CPU shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout, GatheredDecodeRows
from shardmesh.engine.kv_cache import AnyKVCache, KVCache
from shardmesh.engine.model import Transformer

MIN_LENGTH = 256  # the smallest length bucket: below it a gathered read costs less than a launch gap


def row_bucket(rows: int, max_rows: int) -> int:
    """The smallest power of two >= `rows`, capped at `max_rows`."""
    if not 1 <= rows <= max_rows:
        raise ValueError(f"rows must be in [1, {max_rows}], got {rows}")
    return min(1 << (rows - 1).bit_length(), max_rows)


def length_bucket(length: int, max_len: int) -> int:
    """The smallest power of two >= `length` (at least MIN_LENGTH), capped at the cache's `max_len`."""
    if not 1 <= length <= max_len:
        raise ValueError(f"length must be in [1, {max_len}], got {length}")
    return min(max(1 << (length - 1).bit_length(), MIN_LENGTH), max_len)


def decode_graphs(model: Transformer, cache: AnyKVCache, device: torch.device, tp_size: int,
                  compile: bool = False) -> DecodeGraphs | None:  # fmt: skip
    """Graphs for a shard whose decode steps can replay from them (see the module docstring), else None."""
    if device.type == "cuda" and isinstance(cache, KVCache) and tp_size == 1:
        return DecodeGraphs(model, cache, device, compile=compile)
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run uncaptured (CPU tests of the fixed-shape path)
    out: Tensor
    layout: BatchLayout


class DecodeGraphs:
    """Runs eligible decode steps of one shard through captured graphs (`capture=False`: the same fixed-shape
    path without capturing, so it can be checked on a CPU)."""

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device, max_rows: int | None = None,
                 capture: bool = True, compile: bool = False) -> None:  # fmt: skip
        self.model, self.cache, self.device, self.capture = model, cache, device, capture
        # torch.compile fuses the step's small elementwise kernels (norms, rope, SwiGLU) before the capture
        self.forward_fn = torch.compile(model, dynamic=False) if compile else model
        self.max_rows = max_rows or cache.num_slots
        first = model.is_first
        shape = (self.max_rows,) if first else (self.max_rows, model.cfg.hidden_size)
        self.inputs = torch.zeros(shape, dtype=torch.long if first else model.dtype, device=device)
        self.index = torch.zeros((2, self.max_rows), dtype=torch.long, device=device)  # each row's slot, position
        self.slots, self.positions = self.index[0], self.index[1]
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = None  # the memory pool the graphs share, after the first capture

    def accepts(self, batch: BatchLayout, all_logits: bool) -> bool:
        """A step of one-token segments only, few enough, as a slot layout, last-token logits."""
        return (not all_logits and batch.block_size == 0 and len(batch.segments) <= self.max_rows
                and all(s.length == 1 for s in batch.segments))  # fmt: skip

    @torch.inference_mode()
    def run(self, batch: BatchLayout, x: Tensor) -> Tensor:
        """The shard's output for `batch` (which `accepts`): (n, vocab) logits or (n, hidden) activations."""
        segments = batch.segments
        n = len(segments)
        rows = row_bucket(n, self.max_rows)
        length = length_bucket(max(s.start for s in segments) + 1, self.cache.max_len)
        pad = rows - n
        # One copy from pageable memory: it returns once the bytes are staged, so the next step can reuse nothing
        # early (a pinned buffer refilled each step would race its own asynchronous copy).
        self.index[:, :rows].copy_(torch.tensor([[s.slot for s in segments] + [segments[0].slot] * pad,
                                                 [s.start for s in segments] + [segments[0].start] * pad]))  # fmt: skip
        self.inputs[:n].copy_(x)
        if pad:
            self.inputs[n:rows].copy_(x[:1].expand(pad, *x.shape[1:]))
        g = self.graphs.get((rows, length))
        if g is None:
            g = self.graphs[(rows, length)] = self._capture(rows, length)
        elif g.graph is not None:
            g.graph.replay()
            if self.model.streamer is not None:  # layers streamed from host memory: count what the replay copied
                self.model.streamer.replayed()
        else:
            g.out.copy_(self._forward(rows, g.layout))
        # A copy: the next replay overwrites `out` while the caller may still hold this step's rows.
        return g.out[:n].clone()

    def _layout(self, rows: int, length: int) -> BatchLayout:
        slots, positions = self.slots[:rows], self.positions[:rows]
        mask = torch.empty((rows, 1, 1, length), dtype=torch.bool, device=self.device)  # filled by `_forward`
        decode = GatheredDecodeRows(slice(0, rows), slots, length, mask)
        # Segments only for the cache's range check (slot 0, position 0: always in range).
        segments = tuple(Segment(0, 0, 1) for _ in range(rows))
        last = torch.arange(rows, device=self.device)
        return BatchLayout(segments, positions, last, (slots, positions), decode)

    def _forward(self, rows: int, layout: BatchLayout) -> Tensor:
        # The mask is rebuilt from the positions buffer inside the forward, so a replay sees this step's positions.
        positions = self.positions[:rows]
        assert isinstance(layout.decode, GatheredDecodeRows)
        layout.decode.mask.copy_(
            (torch.arange(layout.decode.length, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        )
        return self.forward_fn(self.inputs[:rows], layout, self.cache)

    def _capture(self, rows: int, length: int) -> _Graph:
        layout = self._layout(rows, length)
        if not self.capture:
            return _Graph(None, self._forward(rows, layout), layout)
        # Warm up on a side stream (lazy cuBLAS and allocator state must not be created during capture); the
        # warm-up computes this very step, so its writes to the cache are the ones the replay makes again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(rows, layout)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(rows, layout)
        self.pool = graph.pool()
        graph.replay()
        return _Graph(graph, out, layout)
