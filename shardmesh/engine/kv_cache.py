"""The KV cache of one shard: keys and values of every sequence it serves, for its own layers.

Two layouts, chosen when the stage is built (`Transformer.make_cache` / `make_paged_cache`), each knowing how
to write a step's keys and values and how to read them back for attention (`Attention` calls `write`,
`attend_decode` and `history`, whichever the cache):

- `KVCache`, by slot: a sequence owns a whole slot of `max_len` positions.
- `PagedKVCache`, by block: a pool of fixed-size blocks, and each sequence's block table (`Segment.blocks`,
  kept by the gateway) says which blocks hold its positions, so memory follows the tokens actually held and
  full blocks of a common prefix can be shared by several sequences.

The activation logs (`ActivationLog`, `PagedActivationLog`) are addressed the same way as their caches, so
one block table (or slot) indexes both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardmesh.core.step import Segment
from shardmesh.engine import paged_attention
from shardmesh.engine.batch import BatchLayout, DecodeRows, GatheredDecodeRows, PagedDecodeRows
from shardmesh.engine.paged_attention import DecodeKernel


class _Cache:
    """What both layouts share: one tensor allocated up front, and its size."""

    data: Tensor
    block_size: int  # 0 for slots

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class KVCache(_Cache):
    """Static keys and values for `num_slots` sequences of up to `max_len` tokens, per local layer.

    Allocated once, up front, so memory use is known before the first request and never grows.
    Shape per layer: (num_slots, kv_heads, max_len, head_dim).
    """

    block_size = 0
    attention_kernel = "slot-sdpa"

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, 2, num_slots, kv_heads, max_len, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots

    def keys(self, layer: int) -> Tensor:
        return self.data[layer, 0]  # (num_slots, kv_heads, max_len, head_dim)

    def values(self, layer: int) -> Tensor:
        return self.data[layer, 1]

    def write(self, layer: int, batch: BatchLayout, k: Tensor, v: Tensor) -> None:
        """k, v: (T, kvh, hd), the step's new keys and values, each at its token's (slot, position)."""
        slot, position = batch.kv_index
        self.keys(layer)[slot, :, position] = k
        self.values(layer)[slot, :, position] = v

    def check(self, batch: BatchLayout) -> None:
        """Raise a ValueError naming the segment unless `batch` fits this cache."""
        if batch.block_size:
            raise ValueError(f"the layout is for a paged cache (block_size={batch.block_size}), this KV cache has "
                             f"slots: build it without block_size")  # fmt: skip
        for s in batch.segments:
            if not 0 <= s.slot < self.num_slots or s.start + s.length > self.max_len:
                raise ValueError(f"{s.name} does not fit a KV cache of {self.num_slots} slots of {self.max_len} "
                                 f"positions")  # fmt: skip

    def attend_decode(self, layer: int, q: Tensor, d: DecodeRows | PagedDecodeRows | GatheredDecodeRows) -> Tensor:
        """q: (D, h, hd), one new query per sequence, read against the slot range as a view → (D, h, hd).

        The g query heads sharing a kv head become that head's g queries, (span, kvh, g, hd), as in
        `Attention._attend`."""
        D, h, hd = q.shape
        kvh = self.data.shape[3]
        grouped = q.view(D, kvh, h // kvh, hd)
        if isinstance(d, GatheredDecodeRows):  # fixed shapes for a CUDA graph: each row's slot gathered
            keys = self.keys(layer)[:, :, : d.length].index_select(0, d.slots)  # (D, kvh, length, hd)
            values = self.values(layer)[:, :, : d.length].index_select(0, d.slots)
            o = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=d.mask)
            return o.reshape(D, h, hd)
        assert isinstance(d, DecodeRows)
        if not d.in_order:  # place each query at its slot's index in the range
            grouped = grouped.new_zeros((d.span, *grouped.shape[1:])).index_copy_(0, d.index, grouped)
        window = slice(d.first_slot, d.first_slot + d.span)
        keys, values = self.keys(layer)[window, :, : d.length], self.values(layer)[window, :, : d.length]
        o = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=d.mask)
        if not d.in_order:
            o = o.index_select(0, d.index)
        return o.reshape(D, h, hd)

    def history(self, layer: int, batch: BatchLayout, i: int) -> tuple[Tensor, Tensor]:
        """Keys and values (kvh, start + length, hd) of `batch.looped[i]`'s positions so far: views."""
        seg = batch.looped[i][1]
        end = seg.start + seg.length
        return self.keys(layer)[seg.slot, :, :end], self.values(layer)[seg.slot, :, :end]


class PagedKVCache(_Cache):
    """Keys and values in a pool of `num_blocks` blocks of `block_size` positions, per local layer, shared by
    all sequences through their block tables (`Segment.blocks`). Allocated once, up front, like `KVCache`.

    Shape (layers, 2, num_blocks, kv_heads, block_size * head_dim): per layer, block and kv head one tile of keys
    stored (head_dim, block_size) and one of values (block_size, head_dim) (`keys`, `values`). Why: the decode
    kernel (`paged_attention`) works on one (sequence, kv head) at a time and walks its blocks, so each tile is
    contiguous (16 x 64 float32: 4 KiB, streamed whole); keys transposed make a block's scores vectors along its
    positions (no horizontal sums), values as they are make the output vectors along head_dim. A write scatters
    each token's (kv_heads, head_dim) into its tiles instead: T tokens per step, negligible beside the reads.
    """

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 kernel: DecodeKernel | None = None) -> None:  # fmt: skip
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.data = torch.zeros((num_layers, 2, num_blocks, kv_heads, block_size * head_dim), dtype=dtype,
                                device=device)  # fmt: skip
        self.num_blocks, self.block_size, self.kv_heads, self.head_dim = num_blocks, block_size, kv_heads, head_dim
        self.kernel = kernel or paged_attention.choose(device)  # the decode read, chosen once here

    def keys(self, layer: int) -> Tensor:
        """(num_blocks, kv_heads, head_dim, block_size): a view."""
        return self.data[layer, 0].view(self.num_blocks, self.kv_heads, self.head_dim, self.block_size)

    def values(self, layer: int) -> Tensor:
        """(num_blocks, kv_heads, block_size, head_dim): a view."""
        return self.data[layer, 1].view(self.num_blocks, self.kv_heads, self.block_size, self.head_dim)

    def write(self, layer: int, batch: BatchLayout, k: Tensor, v: Tensor) -> None:
        """k, v: (T, kvh, hd), the step's new keys and values, each at its token's (block, offset)."""
        block, offset = batch.kv_index
        self.keys(layer)[block, :, :, offset] = k
        self.values(layer)[block, :, offset] = v

    @property
    def attention_kernel(self) -> str:
        return self.kernel.name

    def check(self, batch: BatchLayout) -> None:
        """Raise a ValueError naming the segment and the numbers unless `batch` fits this cache."""
        if batch.block_size != self.block_size:
            raise ValueError(f"the layout has block_size={batch.block_size}, this paged KV cache {self.block_size}: "
                             f"build it with BatchLayout.build(..., block_size={self.block_size})")  # fmt: skip
        if batch.max_block >= self.num_blocks:
            for s in batch.segments:
                s.check_blocks(self.block_size, self.num_blocks)

    def attend_decode(self, layer: int, q: Tensor, d: DecodeRows | PagedDecodeRows) -> Tensor:
        """q: (D, h, hd), one new query per sequence, against its blocks where they lie → (D, h, hd)."""
        assert isinstance(d, PagedDecodeRows)
        return self.kernel(q, self.keys(layer), self.values(layer), d.tables, d.lengths)

    def history(self, layer: int, batch: BatchLayout, i: int) -> tuple[Tensor, Tensor]:
        """Keys and values (kvh, start + length, hd) of `batch.looped[i]`'s positions so far, gathered from its
        blocks into contiguous tensors. A copy, but of a prompt chunk: its attention costs length x context
        products against this one pass over the context, and `Attention._attend` keeps SDPA's fused kernel."""
        seg = batch.looped[i][1]
        k, v = paged_attention.gather_blocks(self.keys(layer), self.values(layer), batch.chunk_blocks[i])
        end = seg.start + seg.length
        return k[:, :end], v[:, :end]


AnyKVCache = KVCache | PagedKVCache  # the two layouts; a stage is built with one


class ActivationLog:
    """What a stage that is not the last sent on, per slot and position: its output hidden states.

    Why: when the next stage's worker is lost, its replacement must rebuild the KV cache of every running
    sequence, and the input it needs for that is exactly what this stage once sent it. With the log, this
    stage resends those rows instead of recomputing them (and the stages before it do nothing), so a
    replay costs the lost stage's layers only (`StageEngine.step`, `BatchEntry.first_stage`).

    Shape (num_slots, max_len, hidden). Allocated uninitialized: a row is read only after the step that
    wrote it, and untouched pages cost no memory until a sequence reaches them.
    """

    block_size = 0

    def __init__(self, num_slots: int, max_len: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        self.data = torch.empty((num_slots, max_len, hidden), dtype=dtype, device=device)

    def record(self, batch: BatchLayout, rows: Tensor) -> None:
        """Write `rows` (T, hidden), the step's output, at each token's place (`batch.kv_index`)."""
        if batch.block_size != self.block_size:
            raise ValueError(f"the layout has block_size={batch.block_size}, this activation log {self.block_size}")
        self.data[batch.kv_index] = rows

    def rows(self, seg: Segment) -> Tensor:
        """The rows recorded for positions [start, start + length) of `seg`'s slot."""
        return self.data[seg.slot, seg.start : seg.start + seg.length]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class PagedActivationLog(ActivationLog):
    """`ActivationLog` over the blocks of a `PagedKVCache`: shape (num_blocks, block_size, hidden), indexed by
    the same block tables. A shared prefix block holds the rows of the sequence that wrote it, which are those
    of every sequence sharing it (same tokens at the same positions)."""

    def __init__(self, num_blocks: int, block_size: int, hidden: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:  # fmt: skip
        super().__init__(num_blocks, block_size, hidden, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size

    def rows(self, seg: Segment) -> Tensor:
        """The rows recorded for positions [start, start + length) of `seg`, through its block table."""
        seg.check_blocks(self.block_size, self.num_blocks)
        positions = torch.arange(seg.start, seg.start + seg.length)
        table = torch.tensor(seg.blocks, dtype=torch.long)
        return self.data[table[positions // self.block_size].to(self.data.device),
                         (positions % self.block_size).to(self.data.device)]  # fmt: skip
