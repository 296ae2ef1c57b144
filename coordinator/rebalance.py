"""Moving a slot onto a faster spare: which move, if any, is worth making. Pure functions, like placement.

A pipeline decodes as fast as its slowest stage, and a stage as fast as its slowest tensor-parallel shard:
a stage's time is predicted as its layers divided by that shard holder's speed (GFLOP/s, `RegisterRequest`).
A move puts a spare in one slot; its gain is the slowest stage's time before over the slowest stage's time
after. The coordinator makes the best move only when the gain reaches `min_gain` (hysteresis: ~1.3 by
default, so a move never pays for less than it costs), at most a few per minute, and only make-before-break
(the spare loads first, the KV cache moves with the slot: see registry.Registry._maybe_rebalance).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from coordinator.placement import Labels, Slots, Split, fits


@dataclass(frozen=True)
class Speed:
    """A worker's speed as it registered it: GFLOP/s (0: unknown), and its class (empty: declared)."""

    gflops: float = 0.0
    klass: str = ""


@dataclass(frozen=True)
class Move:
    """Put `new` in place of `old` at `rank`: the pipeline's predicted speed-up is `gain`."""

    rank: int
    old: str
    new: str
    gain: float


def effective(speeds: Mapping[str, Speed]) -> dict[str, float]:
    """Each worker's speed for planning: measured speeds of one class are equal (the best of the class), because
    what tells two identical devices apart is only measurement noise; declared speeds stand as given."""
    best: dict[str, float] = {}
    for s in speeds.values():
        if s.klass:
            best[s.klass] = max(best.get(s.klass, 0.0), s.gflops)
    return {w: best[s.klass] if s.klass else s.gflops for w, s in speeds.items()}


def bottleneck(split: Split, slots: Slots, tp: int, speed: Mapping[str, float]) -> float:
    """The slowest stage's predicted time per token (layers / GFLOP/s of its slowest shard); inf if unknown."""
    worst = 0.0
    for s, (start, end) in enumerate(split):
        holders = slots[s * tp : (s + 1) * tp]
        slowest = min((speed.get(h, 0.0) if h is not None else 0.0) for h in holders)
        if slowest <= 0:
            return float("inf")
        worst = max(worst, (end - start) / slowest)
    return worst


def best_move(
    split: Split, slots: Slots, tp: int, speeds: Mapping[str, Speed], spares: Sequence[str],
    requires: Sequence[Labels] | None, labels: Mapping[str, Labels], min_gain: float,
    fits_memory: Callable[[Slots], bool] | None = None,
) -> Move | None:  # fmt: skip
    """The move of one spare into one slot with the highest predicted gain, if it reaches `min_gain` and the
    spare's memory holds the slot's shard (`fits_memory` of the slots after the move, by the planner's model)."""
    speed = effective(speeds)
    before = bottleneck(split, slots, tp, speed)
    if before == float("inf"):
        return None  # a holder of unknown speed: nothing to compare with
    best: Move | None = None
    for spare in spares:
        if speed.get(spare, 0.0) <= 0:
            continue
        for rank, holder in enumerate(slots):
            if holder is None or speed[spare] <= speed.get(holder, 0.0):
                continue
            if not fits(labels.get(spare, ()), requires[rank] if requires else ()):
                continue
            moved = (*slots[:rank], spare, *slots[rank + 1 :])
            gain = before / bottleneck(split, moved, tp, speed)
            if gain >= min_gain and (best is None or gain > best.gain) and (fits_memory is None or fits_memory(moved)):
                best = Move(rank, holder, spare, gain)
    return best
