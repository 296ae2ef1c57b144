"""What tensor-parallel rank `rank` of `size` owns of each dimension tensor parallelism splits, as pure
arithmetic: query and key/value heads (`HeadSplit`), MLP intermediate columns (`mlp_range`) and
vocabulary rows (`vocab_range`). `shardmesh.engine.tp` slices the model by these; the planner counts a
rank's bytes by the same functions, without building the model.
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


def mlp_range(cfg: ModelConfig, rank: int, size: int) -> tuple[int, int]:
    """Intermediate columns [start, end) of the MLP: intermediate_size / size each, so size must divide it."""
    if cfg.intermediate_size % size:
        raise TensorParallelError(
            f"tensor parallel degree {size} must divide intermediate_size={cfg.intermediate_size}"
        )
    share = cfg.intermediate_size // size
    return rank * share, (rank + 1) * share


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """Vocabulary rows [start, end): equal chunks of ceil(vocab / size); the last may be short (or empty)
    when size does not divide vocab."""
    chunk = -(-vocab // size)
    start = min(rank * chunk, vocab)
    return start, min(start + chunk, vocab)


def valid_tp_degrees(cfg: ModelConfig) -> list[int]:
    """Degrees the model splits by: dividing the query heads and intermediate_size, and dividing the kv
    heads or being a multiple of them (each kv head then replicated on tp / kv ranks)."""
    h, kv = cfg.num_heads, cfg.num_kv_heads
    return [d for d in range(1, h + 1) if h % d == 0 and cfg.intermediate_size % d == 0 and _kv_ok(kv, d)]
