"""What one block of a paged KV cache costs a shard, and how many blocks a memory size buys: pure arithmetic.

A shard holding `n` layers, with `kv_heads` kv heads of its own (its share under tensor parallelism, or a
replica: `HeadSplit.kv_count`), pays per block of `block_size` positions, in the serving dtype of `b` bytes:

  keys and values  = 2 × n × kv_heads × head_dim × block_size × b   (`engine.kv_cache.PagedKVCache`)
  activation log   = block_size × hidden × b, on every stage but the last (`PagedActivationLog`: what the
                     stage sent on, by the same block ids, for replays)

Block ids are mesh-wide (the gateway hands out one table per sequence, read by every stage), so every shard holds
the same number of blocks, and the number a memory size buys is set by the shard whose block costs the most.
The slot cache costs the same per position (`planning.memory`: kv_slots × max_context positions), which is
what the default below matches.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import HeadSplit
from shardmesh.core.step import blocks_for
from shardmesh.core.topology import ServingLimits


def block_bytes(layers: int, kv_heads: int, head_dim: int, hidden: int, block_size: int, dtype_bytes: int,
                last_stage: bool) -> int:  # fmt: skip
    """Bytes one block costs a shard of `layers` layers with `kv_heads` local kv heads (module docstring)."""
    kv = 2 * layers * kv_heads * head_dim * block_size * dtype_bytes
    log = 0 if last_stage else block_size * hidden * dtype_bytes
    return kv + log


def placement_block_bytes(cfg: ModelConfig, split: Sequence[tuple[int, int]], tp: int, block_size: int,
                          dtype_bytes: int) -> int:  # fmt: skip
    """Bytes one block costs the most loaded shard of the placement: stages holding layers `split` ([start, end)
    each, in order), each over `tp` tensor-parallel ranks."""
    costs = (
        block_bytes(end - start, HeadSplit.of(cfg, rank, tp).kv_count, cfg.head_dim, cfg.hidden_size, block_size,
                    dtype_bytes, last_stage=end == cfg.num_layers)
        for start, end in split
        for rank in range(tp)
    )  # fmt: skip
    return max(costs)


def slot_cache_blocks(kv_slots: int, max_context: int, block_size: int) -> int:
    """Blocks holding what the slot cache holds (kv_slots × max_context positions, in whole blocks), and at least
    one whole sequence: the default, so a paged cache takes no more memory than slots would (but for the last
    block of a single slot's context, rounded up)."""
    return max(kv_slots * max_context // block_size, blocks_for(max_context, block_size))


def paged_limits(limits: ServingLimits, block_size: int, per_block: int, memory: int | None) -> ServingLimits:
    """`limits` with a paged KV cache of `block_size` positions per block: as many blocks as `memory` bytes buy at
    `per_block` bytes each (`placement_block_bytes`), or with `memory` None as many as the slot cache holds.
    Raises ValueError naming kv_cache_memory and the numbers when `memory` buys less than one whole sequence."""
    if block_size < 1 or per_block < 1:
        raise ValueError(f"kv_block_size and the bytes per block must be >= 1, got {block_size} and {per_block}")
    if memory is None:
        blocks = slot_cache_blocks(limits.kv_slots, limits.max_context, block_size)
    else:
        blocks = memory // per_block
        needed = blocks_for(limits.max_context, block_size)
        if blocks < needed:
            raise ValueError(f"kv_cache_memory: {memory} bytes buy {blocks} blocks of {block_size} tokens at "
                             f"{per_block} bytes each (the most loaded shard's), fewer than one sequence of "
                             f"max_context {limits.max_context} needs: {needed} blocks, {needed * per_block} "
                             f"bytes")  # fmt: skip
    return ServingLimits(limits.kv_slots, limits.max_context, limits.max_batch_tokens, block_size, blocks)
