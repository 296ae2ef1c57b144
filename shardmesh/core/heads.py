"""Tensor parallelism as a transform: `apply_tp(model, group)` swaps a stage's layers for sharded ones.

Run it on the model while it is still on the `meta` device: the sharded modules are created with
their local shapes and record which slice of each checkpoint tensor they hold (`checkpoint_index`),
so the loader reads only those bytes. Every slice is contiguous, so `safe_open(...).get_slice(name)`
reads it without touching the rest of the tensor.

Per decoder layer (Megatron's scheme, one all-reduce per attention and one per MLP):
  attention  q/k/v: column-parallel by heads     o_proj: row-parallel, then all-reduce
  MLP        gate/up: column-parallel by columns down_proj: row-parallel, then all-reduce
At the ends of the model the vocabulary is split: the embedding looks up only its rows and the
partial results are all-reduced; the LM head computes its share of logits and they are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardmesh.core.config import ModelConfig


class TensorParallelError(ValueError):
    pass


@dataclass(frozen=True)
class HeadSplit:
    """Which query and key/value heads rank `rank` of `size` owns."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, size: int) -> HeadSplit:
        h, kv = cfg.num_heads, cfg.num_kv_heads
        if h % size:
            raise TensorParallelError(
                f"tensor parallel degree {size} must divide num_attention_heads={h}; "
                f"valid degrees: {[d for d in range(1, h + 1) if h % d == 0 and _kv_ok(kv, d)]}"
            )
        if not _kv_ok(kv, size):
            raise TensorParallelError(
                f"tensor parallel degree {size} does not fit num_key_value_heads={kv}: it must divide it "
                f"or be a multiple of it"
            )
        q_count = h // size
        if size <= kv:
            kv_count = kv // size
            return cls(rank * q_count, q_count, rank * kv_count, kv_count)
        # More ranks than kv heads: each kv head is replicated on the size // kv ranks whose query
        # heads read it (query head i reads kv head i // (h // kv)).
        return cls(rank * q_count, q_count, (rank * q_count) // (h // kv), 1)


def _kv_ok(kv: int, size: int) -> bool:
    return kv % size == 0 if size <= kv else size % kv == 0
