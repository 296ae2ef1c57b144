"""What tensor-parallel rank `rank` of `size` owns of each dimension tensor parallelism splits, as pure
arithmetic: query and key/value heads (`HeadSplit`), MLP intermediate columns (`mlp_range`) and
vocabulary rows (`vocab_range`). `shardmesh.engine.tp` slices the model by these; the planner counts a
rank's bytes by the same functions, without building the model.

The heads are split evenly. The MLP columns and the vocabulary may be split in proportion to a `TpSplit`, one
whole-number share per rank (`--tp-split 2,1,1`, as llama.cpp's `--tensor-split`): ranks on unequal devices, or on
fewer cores than ranks, where one rank alone on a core does two shares while two share the other core. The MLP and
the vocabulary are ~80% of a Llama's weights per token; the heads stay even because a model's few key-value heads
rarely split any other way (SmolLM2's 3 over 3 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardmesh.core.config import ModelConfig


class TensorParallelError(ValueError):
    pass


TpSplit = tuple[int, ...]  # each rank's share of the MLP columns and the vocabulary; () splits them evenly


def parse_tp_split(text: str) -> TpSplit:
    """ "2,1,1" -> (2, 1, 1); "" -> () (even). Each share a positive whole number, else a TensorParallelError."""
    if not text.strip():
        return ()
    try:
        split = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise TensorParallelError(f"tp split {text!r}: expected whole numbers and commas, e.g. 2,1,1") from None
    if min(split) < 1:
        raise TensorParallelError(f"tp split {text!r}: every share must be at least 1")
    return split


def format_tp_split(split: TpSplit) -> str:
    """(2, 1, 1) -> "2,1,1": what `parse_tp_split` reads (a flag's value)."""
    return ",".join(map(str, split))


def check_tp_split(cfg: ModelConfig, size: int, split: TpSplit) -> None:
    """A TensorParallelError saying what is wrong unless `split` (non-empty) gives each of `size` ranks a positive
    share and its total divides intermediate_size (each rank's columns a whole number of shares)."""
    if not split:
        return
    text = format_tp_split(split)
    if len(split) != size:
        raise TensorParallelError(f"tp split {text} has {len(split)} shares for tensor parallel degree {size}")
    if min(split) < 1:
        raise TensorParallelError(f"tp split {text}: every share must be at least 1")
    if cfg.intermediate_size % sum(split):
        raise TensorParallelError(f"tp split {text}: its shares add up to {sum(split)}, which must divide "
                                  f"intermediate_size={cfg.intermediate_size}")  # fmt: skip


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


def mlp_range(cfg: ModelConfig, rank: int, size: int, split: TpSplit = ()) -> tuple[int, int]:
    """Intermediate columns [start, end) of the MLP: intermediate_size / size each, so size must divide it; with
    `split`, rank r's shares of intermediate_size / sum(split) columns each (`check_tp_split`)."""
    if split:
        check_tp_split(cfg, size, split)
        unit = cfg.intermediate_size // sum(split)
        start = sum(split[:rank]) * unit
        return start, start + split[rank] * unit
    if cfg.intermediate_size % size:
        raise TensorParallelError(
            f"tensor parallel degree {size} must divide intermediate_size={cfg.intermediate_size}"
        )
    share = cfg.intermediate_size // size
    return rank * share, (rank + 1) * share


def vocab_range(vocab: int, rank: int, size: int, split: TpSplit = ()) -> tuple[int, int]:
    """Vocabulary rows [start, end): equal chunks of ceil(vocab / size); the last may be short (or empty)
    when size does not divide vocab. With `split`, chunks of rank r's shares of ceil(vocab / sum(split)) rows."""
    shares = split or (1,) * size
    unit = -(-vocab // sum(shares))
    start = min(sum(shares[:rank]) * unit, vocab)
    return start, min(start + shares[rank] * unit, vocab)


def valid_tp_degrees(cfg: ModelConfig) -> list[int]:
    """Degrees the model splits by: dividing the query heads and intermediate_size, and dividing the kv
    heads or being a multiple of them (each kv head then replicated on tp / kv ranks)."""
    h, kv = cfg.num_heads, cfg.num_kv_heads
    return [d for d in range(1, h + 1) if h % d == 0 and cfg.intermediate_size % d == 0 and _kv_ok(kv, d)]
