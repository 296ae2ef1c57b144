"""The layout of one packed step: which rows of the (T, hidden) batch belong to which sequence.

One step carries several sequences back to back; `BatchLayout` says which rows belong to which sequence,
at which positions, and where in the KV cache each token's key and value go (`kv_index`): a slot and a
position for the slot cache (`kv_cache.KVCache`), a block and an offset in it for the paged cache
(`kv_cache.PagedKVCache`, a layout built with `block_size`). The linear layers see all T rows at once;
attention takes the one-token (decode) segments together, in one call per layer (`DecodeRows` for slots,
`PagedDecodeRows` for blocks), and each longer segment (a prompt chunk) on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch
from torch import Tensor

from shardmesh.core.step import Segment, blocks_for, written_blocks


@dataclass(frozen=True)
class DecodeRows:
    """The step's one-token segments, attended together: one attention call per layer, not one per sequence.

    The call reads the KV cache of the slot range [first_slot, first_slot + span) as a view (no copy), up
    to `length` positions; `mask` hides from each slot's query the positions past its own. A slot of the
    range that is in no segment gets a zero query that sees position 0 only, and its output is dropped.
    (Measured, SmolLM2, 16 sequences decoding: 30 attention calls per step instead of 480, and the whole
    step in process 46 -> 35 ms.)
    """

    rows: slice | Tensor  # row of each one-token segment in the packed batch (a slice when they are adjacent)
    slots: Tensor  # (D,) its KV slot
    positions: Tensor  # (D,) its position: where its key goes, and the last one it sees
    index: Tensor  # (D,) slot - first_slot
    first_slot: int
    span: int
    in_order: bool  # row i is slot first_slot + i for every i: the queries need no reordering
    length: int  # positions read per slot: the largest position + 1
    mask: Tensor | None  # (span, 1, 1, length) bool; None when every slot of the range sees all `length`


@dataclass(frozen=True)
class GatheredDecodeRows:
    """One-token segments whose slots are read by gathering them, up to a fixed `length`, whatever the slots and
    positions: the fixed-shape form a captured CUDA graph replays (`cuda_graph.DecodeGraphs`). Its tensors are the
    graph's static buffers, refilled before each replay."""

    rows: slice  # every row of the step, in order
    slots: Tensor  # (D,) each row's KV slot
    length: int  # positions read per slot (a bucket at least the largest position + 1)
    mask: Tensor  # (D, 1, 1, length) bool: each row sees the positions up to its own


@dataclass(frozen=True)
class PagedDecodeRows:
    """The step's one-token segments for a paged cache, all of them (one is enough: the kernel reads blocks in
    place, so one call per layer costs no copy whatever the block ids; `paged_attention`)."""

    rows: slice | Tensor  # row of each one-token segment in the packed batch (a slice when they are adjacent)
    tables: Tensor  # (D, max_blocks) int32: each one's blocks covering [0, position], padded with block 0
    lengths: Tensor  # (D,) int32: positions each one sees, its own included (position + 1)


@dataclass(frozen=True)
class BatchLayout:
    segments: tuple[Segment, ...]
    positions: Tensor  # (T,) int64, the absolute position of every packed token
    last_index: Tensor  # (B,) int64, row of each sequence's last token in the packed batch
    kv_index: tuple[Tensor, Tensor]  # (T,) each: where each token's key goes, (slot, position) or (block, offset)
    decode: DecodeRows | PagedDecodeRows | GatheredDecodeRows | None = (
        None  # the one-token segments, when attended together
    )
    looped: tuple[tuple[int, Segment], ...] = ()  # (first row, segment) attended one at a time
    block_size: int = 0  # the paged cache's block size; 0: a layout for the slot cache
    chunk_blocks: tuple[Tensor, ...] = ()  # paged: each looped segment's blocks covering [0, start + length)
    max_block: int = -1  # paged: the largest block id any segment reads (the cache checks its range)

    @classmethod
    def build(cls, segments: list[Segment] | tuple[Segment, ...], device: torch.device | str = "cpu",
              block_size: int = 0) -> BatchLayout:  # fmt: skip
        """The layout of `segments` for a slot cache, or with `block_size` > 0 for a paged cache of that block
        size (then each segment's `blocks` must cover its positions)."""
        if not segments:
            raise ValueError("a batch needs at least one segment")
        segments = tuple(segments)
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments])
        ends = torch.tensor([s.length for s in segments]).cumsum(0) - 1
        starts = list(accumulate((s.length for s in segments[:-1]), initial=0))  # each segment's first row
        if block_size:
            return _paged(segments, positions, ends, starts, block_size, device)
        ones = [(row, s) for row, s in zip(starts, segments, strict=True) if s.length == 1]
        decode = _decode_rows(ones, device)
        looped = tuple((row, s) for row, s in zip(starts, segments, strict=True) if decode is None or s.length > 1)
        slots = torch.repeat_interleave(
            torch.tensor([s.slot for s in segments]), torch.tensor([s.length for s in segments])
        )
        kv_index = (slots.to(device), positions.to(device))
        return cls(segments, positions.to(device), ends.to(device), kv_index, decode, looped)

    def advanced(self, k: int) -> BatchLayout:
        """The layout of the same segments `k` positions on (each segment's start + k): a decode call's later steps
        (`StageWorkerCore._decode_steps`). For a slot layout its tensors are this one's, the positions moved
        (SmolLM2 on this project's CPUs: ~10 us a step against ~66 for `build`, ~43 against ~255 for 16 sequences);
        a paged or captured-graph layout is built again (its blocks and offsets change with the positions)."""
        segments = tuple(replace(s, start=s.start + k) for s in self.segments)
        decode = self.decode
        if self.block_size or not isinstance(decode, DecodeRows | None):
            return BatchLayout.build(segments, self.positions.device, self.block_size)
        positions = self.positions + k
        if decode is not None:
            ends, length = decode.positions + k, decode.length + k
            mask = None if decode.mask is None else _mask(decode.index, ends, decode.span, length)
            decode = replace(decode, positions=ends, length=length, mask=mask)
        rows = {row for row, _ in self.looped}  # a segment's first row names it: every segment has one at least
        starts = accumulate((s.length for s in segments[:-1]), initial=0)
        looped = tuple((row, s) for row, s in zip(starts, segments, strict=True) if row in rows)
        return replace(self, segments=segments, positions=positions, kv_index=(self.kv_index[0], positions),
                       decode=decode, looped=looped)  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)


def _paged(segments: tuple[Segment, ...], positions: Tensor, ends: Tensor, starts: list[int], block_size: int,
           device: torch.device | str) -> BatchLayout:  # fmt: skip
    """A layout for a paged cache: every token's (block, offset), every one-token segment in `PagedDecodeRows`,
    and the blocks each longer one reads."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for s in segments:
        s.check_blocks(block_size)
    _check_disjoint_writes(segments, block_size)
    tables = [torch.tensor(s.blocks[: blocks_for(s.start + s.length, block_size)]) for s in segments]
    pairs = zip(segments, tables, strict=True)
    blocks = torch.cat([t[torch.arange(s.start, s.start + s.length) // block_size] for s, t in pairs])
    kv_index = (blocks.to(device), (positions % block_size).to(device))
    ones = [(row, s, t) for row, s, t in zip(starts, segments, tables, strict=True) if s.length == 1]
    decode = None
    if ones:
        width = max(len(t) for _, _, t in ones)
        table = torch.zeros((len(ones), width), dtype=torch.int32)
        for i, (_, _, t) in enumerate(ones):
            table[i, : len(t)] = t
        lengths = torch.tensor([s.start + 1 for _, s, _ in ones], dtype=torch.int32)
        decode = PagedDecodeRows(_rows([row for row, _, _ in ones], device), table.to(device), lengths.to(device))
    chunks = [(row, s, t) for row, s, t in zip(starts, segments, tables, strict=True) if s.length > 1]
    max_block = max(int(t.max()) for t in tables)
    return BatchLayout(segments, positions.to(device), ends.to(device), kv_index, decode,
                       tuple((row, s) for row, s, _ in chunks), block_size, tuple(t.to(device) for _, _, t in chunks),
                       max_block)  # fmt: skip


def _check_disjoint_writes(segments: tuple[Segment, ...], block_size: int) -> None:
    """No two segments of one step write into the same block: a block is shared only once full and written, and
    a sequence writes only at its own positions, so two writers of one block is a block-table error."""
    writer: dict[int, Segment] = {}
    for s in segments:
        for b in written_blocks(s.blocks, s.start, s.length, block_size):
            if b in writer:
                raise ValueError(f"{s.name} and {writer[b].name} both write block {b} in one step")
            writer[b] = s


def _rows(rows: list[int], device: torch.device | str) -> slice | Tensor:
    """Rows of the packed batch: a slice when they are adjacent (no index copy), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _decode_rows(ones: list[tuple[int, Segment]], device: torch.device | str) -> DecodeRows | None:
    """Attend the one-token segments together when their slots are dense: a range at most twice their
    number (the scheduler hands out the lowest free slots, so decoding sequences usually are); otherwise
    one call each, which reads no slot that is not in the step."""
    if len(ones) < 2:
        return None  # one call either way
    slots = [s.slot for _, s in ones]
    first, span = min(slots), max(slots) - min(slots) + 1
    if span > 2 * len(ones):
        return None
    ends = [s.start for _, s in ones]  # a one-token segment's position is its start
    length = max(ends) + 1
    index = [x - first for x in slots]

    def t(xs: list[int]) -> Tensor:
        return torch.tensor(xs, device=device)

    at, positions = t(index), t(ends)
    mask = _mask(at, positions, span, length) if span != len(ones) or min(ends) != length - 1 else None
    in_order = index == list(range(span))
    return DecodeRows(_rows([row for row, _ in ones], device), t(slots), positions, at, first, span, in_order,
                      length, mask)  # fmt: skip


def _mask(index: Tensor, positions: Tensor, span: int, length: int) -> Tensor:
    """`DecodeRows.mask`: slot first_slot + index[i] sees positions up to positions[i]; a slot of the range in no
    segment, position 0 only."""
    last = torch.zeros(span, dtype=torch.long, device=positions.device)
    last[index] = positions
    return (torch.arange(length, device=positions.device)[None, :] <= last[:, None])[:, None, None, :]
