"""Where a shard sits in the mesh, and the process groups it talks over, as explicit objects.

No `torch.distributed.init_process_group`: that creates a hidden global default group, and our
topology changes at run time. Instead every group is a c10d `ProcessGroup` object built from a
store prefix that names the topology version, so a process can form new groups for a new topology
next to (and then instead of) the old ones without restarting.

Rank layout: global rank = stage * tp + tp_rank, i.e. `torch.arange(pp * tp).reshape(pp, tp)`.
A stage's tensor-parallel group is one row; rank t of stage s sends activations to rank t of s+1
(after the row-parallel all-reduce every tp rank holds the same hidden state, so each pair of
neighbours forms its own point-to-point link and no extra broadcast is needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """What one process holds: layers [layer_start, layer_end) × tensor-parallel slice tp_rank of tp_size."""

    layer_start: int
    layer_end: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end <= self.num_layers:
            raise ValueError(
                f"layer range [{self.layer_start}, {self.layer_end}) must be non-empty and within "
                f"[0, {self.num_layers})"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, {self.tp_size})")

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.num_layers


def split_layers(num_layers: int, stages: int, weights: list[float] | None = None) -> list[tuple[int, int]]:
    """Half-open layer ranges for `stages` pipeline stages, proportional to `weights` (even by default).

    Largest-remainder rounding keeps the total exact; every stage gets at least one layer.
    """
    if stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {stages} stages: each stage needs a layer")
    w = weights or [1.0] * stages
    if len(w) != stages or any(x <= 0 for x in w):
        raise ValueError(f"need {stages} positive stage weights, got {w}")
    spare = num_layers - stages  # one layer is reserved per stage, the rest is shared out
    exact = [spare * x / sum(w) for x in w]
    counts = [1 + int(e) for e in exact]
    by_remainder = sorted(range(stages), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[: num_layers - sum(counts)]:
        counts[i] += 1
    return layer_ranges(counts)


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive half-open layer ranges holding `counts[s]` layers each: [2, 3] -> [(0, 2), (2, 5)]."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def shard_specs(num_layers: int, pp: int, tp: int) -> list[ShardSpec]:
    """One spec per global rank, in rank order (stage-major)."""
    return [ShardSpec(start, end, num_layers, t, tp) for start, end in split_layers(num_layers, pp) for t in range(tp)]
