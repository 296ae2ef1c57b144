"""The paged KV cache's arithmetic: a block costs a shard exactly what `build_shard`'s paged cache and activation
log hold per block, the same per position as the slot cache the planner counts, and the placement's blocks are
set by its most loaded shard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import HeadSplit, valid_tp_degrees
from shardmesh.core.layout import ShardSpec, split_layers
from shardmesh.core.topology import ServingLimits
from shardmesh.engine.kv_cache import PagedActivationLog
from shardmesh.engine.loader import build_shard
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.planning.kv_blocks import block_bytes, paged_limits, placement_block_bytes, slot_cache_blocks
from shardmesh.planning.memory import load_model, shard_memory
from tests.unit.planning.test_memory import FAMILIES

BS = 16


@pytest.mark.parametrize("family", ["gqa-tied", "kv-replicated"])
def test_a_block_costs_what_the_paged_cache_and_log_hold(family: str, tmp_path: Path) -> None:
    """Exact for every shard of every (pp, tp), replicated kv heads included, as is the memory model's kv term for a
    paged mesh; and per position the same as the slot cache `planning.memory` counts (its formula, written
    independently)."""
    model_dir = write_checkpoint(tmp_path / family, FAMILIES[family])
    model, cfg = load_model(model_dir), ModelConfig.from_dir(model_dir)
    slots = ServingLimits(kv_slots=3, max_context=48, max_batch_tokens=16)
    blocks = 5
    for pp in (1, 2):
        for tp in [d for d in valid_tp_degrees(cfg) if d <= 2]:
            for start, end in split_layers(cfg.num_layers, pp):
                for rank in range(tp):
                    shard = build_shard(model_dir, ShardSpec(start, end, cfg.num_layers, rank, tp),
                                        dtype=torch.bfloat16, max_len=slots.max_context, progress=False)  # fmt: skip
                    held = shard.make_paged_cache(blocks, BS, torch.bfloat16, "cpu").nbytes
                    if not shard.is_last:
                        held += PagedActivationLog(blocks, BS, cfg.hidden_size, torch.bfloat16).nbytes
                    last = end == cfg.num_layers
                    one = block_bytes(end - start, HeadSplit.of(cfg, rank, tp).kv_count, cfg.head_dim,
                                      cfg.hidden_size, BS, 2, last)  # fmt: skip
                    assert blocks * one == held, (family, pp, tp, rank)
                    paged = ServingLimits(3, 48, 16, BS, blocks)  # the memory model counts what is allocated
                    assert shard_memory(model, (start, end), tp, rank, "bfloat16", paged).kv_cache == held
                    slot_cache = shard_memory(model, (start, end), tp, rank, "bfloat16", slots).kv_cache
                    assert one * slots.kv_slots * slots.max_context == slot_cache * BS


def test_the_most_loaded_shard_sets_the_block_cost() -> None:
    cfg = ModelConfig.from_hf(FAMILIES["gqa-tied"])  # 5 layers, 2 kv heads, head_dim 12, hidden 48
    per_layer = 2 * 1 * 12 * BS * 4  # tp=2: one kv head each; float32
    log = BS * 48 * 4
    # Stage 0 holds 2 layers and a log, stage 1 3 layers and none: 2 × 1536 + 3072 = 6144 against 3 × 1536 = 4608.
    assert placement_block_bytes(cfg, [(0, 2), (2, 5)], 2, BS, 4) == 2 * per_layer + log == 6144
    assert placement_block_bytes(cfg, [(0, 1), (1, 5)], 2, BS, 4) == 4 * per_layer == 6144
    assert placement_block_bytes(cfg, [(0, 5)], 1, BS, 4) == 5 * 2 * per_layer


def test_the_default_holds_what_slots_hold_and_a_memory_size_buys_whole_blocks() -> None:
    slots = ServingLimits(kv_slots=8, max_context=100, max_batch_tokens=100)
    assert slot_cache_blocks(8, 100, 16) == 50  # 800 positions
    assert slot_cache_blocks(1, 100, 16) == 7  # one whole context, its last block rounded up
    assert paged_limits(slots, 16, 1000, None) == ServingLimits(8, 100, 100, 16, 50)
    assert paged_limits(slots, 16, 1000, 7999) == ServingLimits(8, 100, 100, 16, 7)
    message = ("kv_cache_memory: 6999 bytes buy 6 blocks of 16 tokens at 1000 bytes each (the most loaded shard's), "
               "fewer than one sequence of max_context 100 needs: 7 blocks, 7000 bytes")  # fmt: skip
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        paged_limits(slots, 16, 1000, 6999)
