"""The pipeline's layer split, in one place: which half-open layer range [start, end) each stage holds.

A split of `num_layers` over `pp` stages is `pp` consecutive, non-empty ranges covering [0, num_layers)
(`check_split`), built from layer counts by `layer_ranges`: [18, 12] -> [(0, 18), (18, 30)]. Ways to
choose the counts, all pure:

  split_layers    ∝ weights (even by default), one layer per stage reserved; largest remainder
                  (the coordinator's default, the planner's memory / speed balance)
  capped_split    ∝ weights, each count within [1, cap] (the planner, when memory caps a stage)
  split_by_speed  minimises the slowest stage's time under a linear cost model (the balance check)
  parse_split     a person's `--layers 18,12`

`shard_specs` turns the even split into one `ShardSpec` per global rank, stage-major
(rank = stage × tp + tp_rank).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Ranges = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class ShardSpec:
    """What one process holds: layers [layer_start, layer_end) × tensor-parallel slice tp_rank of tp_size (the MLP
    columns and vocabulary split by `tp_split`'s shares, evenly when it is empty: `shardmesh.core.heads`)."""

    layer_start: int
    layer_end: int
    num_layers: int
    tp_rank: int = 0
    tp_size: int = 1
    tp_split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end <= self.num_layers:
            raise ValueError(
                f"layer range [{self.layer_start}, {self.layer_end}) must be non-empty and within "
                f"[0, {self.num_layers})"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be in [0, {self.tp_size})")
        if self.tp_split and (len(self.tp_split) != self.tp_size or min(self.tp_split) < 1):
            raise ValueError(f"tp_split {self.tp_split} must give each of the {self.tp_size} ranks a positive share")

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)

    @property
    def is_first(self) -> bool:
        return self.layer_start == 0

    @property
    def is_last(self) -> bool:
        return self.layer_end == self.num_layers


# --- counts <-> ranges --------------------------------------------------------------------------------------


def layer_ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive half-open layer ranges holding `counts[s]` layers each: [2, 3] -> [(0, 2), (2, 5)]."""
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def layer_counts(split: Ranges) -> list[int]:
    """Layers per stage: [(0, 2), (2, 5)] -> [2, 3]."""
    return [end - start for start, end in split]


def check_split(split: Ranges, num_layers: int, pp: int) -> None:
    """A split must cover [0, num_layers) with `pp` contiguous, non-empty ranges; ValueError naming the
    first stage that does not."""
    start = 0
    for s, (a, b) in enumerate(split):
        if a != start or b <= a:
            raise ValueError(f"stage {s}: layer range [{a}, {b}) must start at {start} and be non-empty")
        start = b
    if len(split) != pp or start != num_layers:
        raise ValueError(f"a split of {num_layers} layers over {pp} stages, got {list(split)}")


def parse_split(text: str, num_layers: int, pp: int) -> list[tuple[int, int]]:
    """A person's layer counts per stage, "18,12", as ranges [(0, 18), (18, 30)]; ValueError saying what
    was expected."""
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"expected layer counts per stage like 18,12, got {text!r}") from None
    if len(counts) != pp or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(f"need {pp} counts >= 1 (one per stage) adding up to the model's {num_layers} layers, "
                         f"got {text!r}")  # fmt: skip
    return layer_ranges(counts)


def format_split(split: Ranges) -> str:
    """The form `parse_split` reads: [(0, 18), (18, 30)] -> "18,12"."""
    return ",".join(str(n) for n in layer_counts(split))


# --- choosing the counts ------------------------------------------------------------------------------------


def split_layers(num_layers: int, stages: int, weights: Sequence[float] | None = None) -> list[tuple[int, int]]:
    """Half-open layer ranges for `stages` pipeline stages, proportional to `weights` (even by default).

    Every stage gets one layer; the other L - S are shared as (L - S) · w_s / Σw, floored, and the layers
    the flooring left over go to the largest remainders, so the total is exact.
    """
    if stages < 1:
        raise ValueError(f"pipeline stages must be >= 1, got {stages}")
    if stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers over {stages} stages: each stage needs a layer")
    w = list(weights or [1.0] * stages)
    if len(w) != stages or any(x <= 0 for x in w):
        raise ValueError(f"need {stages} positive stage weights, got {w}")
    spare = num_layers - stages
    exact = [spare * x / sum(w) for x in w]
    counts = [1 + int(e) for e in exact]
    by_remainder = sorted(range(stages), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in by_remainder[: num_layers - sum(counts)]:
        counts[i] += 1
    return layer_ranges(counts)


def _check_caps(total: int, stages: int, caps: Sequence[int]) -> None:
    if len(caps) != stages or not stages <= total <= sum(caps) or min(caps) < 1:
        raise ValueError(f"cannot place {total} layers on {stages} stages with capacities {list(caps)}")


def capped_split(total: int, weights: Sequence[float], caps: Sequence[int]) -> list[tuple[int, int]]:
    """Layer ranges with counts ∝ `weights`, each in [1, cap]; requires 1 <= cap and Σ cap >= total >= stages.

    Water-filling: find λ with Σ clip(λ·w_s, 1, cap_s) = total (bisection; the sum grows with λ), floor
    the shares, then give the layers still unplaced to the largest remainders among stages below cap.
    """
    stages = len(weights)
    _check_caps(total, stages, caps)

    def shares(lam: float) -> list[float]:
        return [min(float(c), max(1.0, lam * w)) for w, c in zip(weights, caps, strict=True)]

    lo, hi = 0.0, float(total) / min(weights) + 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(shares(mid)) < total else (lo, mid)
    exact = shares(hi)
    counts = [min(c, max(1, math.floor(x + 1e-9))) for x, c in zip(exact, caps, strict=True)]
    by_remainder = sorted(range(stages), key=lambda i: exact[i] - counts[i], reverse=True)
    while sum(counts) < total:
        i = next(i for i in by_remainder if counts[i] < caps[i])
        counts[i] += 1
        by_remainder.remove(i)
        by_remainder.append(i)
    while sum(counts) > total:  # only from float slack; take from the stage with the smallest remainder
        i = next(i for i in reversed(by_remainder) if counts[i] > 1)
        counts[i] -= 1
    return layer_ranges(counts)


# How a running mesh may re-split its layers: never, or by the stage times the balance check measures.
REBALANCES = ("none", "by-speed")


def split_by_speed(
    num_layers: int, fixed_ms: Sequence[float], per_layer_ms: Sequence[float], caps: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """The layer split that minimises the slowest stage's predicted time, stage s taking
    ``fixed_ms[s] + n_s * per_layer_ms[s]`` for n_s layers (its embedding / LM head cost is fixed: it stays
    with the stage), with 1 <= n_s <= caps[s] (the layers its memory holds).

    Greedy: every stage starts with one layer, and each further layer goes where the stage's time after
    taking it is smallest. With costs that grow by a constant per layer this is optimal for the maximum
    (an exchange argument: any split with a smaller maximum would have had to take a cheaper step).
    """
    stages = len(fixed_ms)
    caps = list(caps) if caps is not None else [num_layers] * stages
    if len(per_layer_ms) != stages or len(caps) != stages or stages < 1:
        raise ValueError(f"need one fixed cost, per-layer cost and cap per stage, got {stages}, "
                         f"{len(per_layer_ms)}, {len(caps)}")  # fmt: skip
    _check_caps(num_layers, stages, caps)
    if min(per_layer_ms) < 0 or min(fixed_ms) < 0:
        raise ValueError("stage costs must be >= 0")
    counts = [1] * stages
    for _ in range(num_layers - stages):
        open_ = [s for s in range(stages) if counts[s] < caps[s]]
        s = min(open_, key=lambda s: (fixed_ms[s] + (counts[s] + 1) * per_layer_ms[s], s))
        counts[s] += 1
    return layer_ranges(counts)


def predicted_ms(split: Ranges, fixed_ms: Sequence[float], per_layer_ms: Sequence[float]) -> list[float]:
    """Each stage's time under `split` by `split_by_speed`'s linear model: fixed_ms[s] + n_s · per_layer_ms[s]."""
    return [f + n * p for n, f, p in zip(layer_counts(split), fixed_ms, per_layer_ms, strict=True)]


def shard_specs(num_layers: int, pp: int, tp: int) -> list[ShardSpec]:
    """One spec per global rank of the even split, in rank order (stage-major: rank = stage × tp + tp_rank)."""
    return [ShardSpec(start, end, num_layers, t, tp) for start, end in split_layers(num_layers, pp) for t in range(tp)]
