"""Layer splits and the rank order of shard specs: pure layout math. Every way of choosing a split (even,
proportional, capped by memory, by measured speed, typed by a person) gives contiguous, non-empty ranges
that cover the model once; the capped and speed splits are optimal by their own measure."""

from __future__ import annotations

import itertools
import random

import pytest

from shardmesh.core.layout import (
    capped_split,
    check_split,
    format_split,
    layer_counts,
    layer_ranges,
    parse_split,
    predicted_ms,
    shard_specs,
    split_by_speed,
    split_layers,
)


@pytest.mark.parametrize("layers,stages", [(n, s) for n in range(1, 12) for s in range(1, n + 1)])
def test_split_layers_covers_every_layer_once(layers: int, stages: int) -> None:
    bounds = split_layers(layers, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [e - s for s, e in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_layers_proportional_and_errors() -> None:
    assert split_layers(30, 2, [2.0, 1.0]) == [(0, 20), (20, 30)]
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 stages"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="positive stage weights"):
        split_layers(4, 2, [1.0, 0.0])


def test_shard_specs_rank_order_is_stage_major() -> None:
    specs = shard_specs(5, 3, 2)
    assert [(s.layer_start, s.layer_end, s.tp_rank) for s in specs] == [
        (0, 2, 0), (0, 2, 1), (2, 4, 0), (2, 4, 1), (4, 5, 0), (4, 5, 1)
    ]  # fmt: skip
    assert specs[0].is_first and specs[-1].is_last and not specs[2].is_first


def test_capped_split_is_proportional_within_caps() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stages = rng.randint(1, 6)
        caps = [rng.randint(1, 20) for _ in range(stages)]
        total = rng.randint(stages, sum(caps))
        weights = [rng.choice([0.5, 1.0, 3.0, 10.0]) for _ in range(stages)]
        split = capped_split(total, weights, caps)
        counts = [e - s for s, e in split]
        assert (
            split[0][0] == 0
            and split[-1][1] == total
            and all(1 <= c <= cap for c, cap in zip(counts, caps, strict=True))
        )
        # No stage below its cap could take a layer from one with a larger share per weight.
        for i in range(stages):
            for j in range(stages):
                if counts[i] < caps[i] and counts[j] > 1:
                    assert (counts[i] + 1) / weights[i] >= (counts[j] - 1) / weights[j] - 1e-9, (split, weights, caps)


def _brute_force_best(num_layers: int, fixed: list[float], per: list[float], caps: list[int]) -> float:
    best = float("inf")
    for counts in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(counts) == num_layers:
            best = min(best, max(f + n * p for f, n, p in zip(fixed, counts, per, strict=True)))
    return best


def test_split_by_speed_is_optimal_and_respects_caps() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stages = rng.randint(1, 4)
        num_layers = rng.randint(stages, 12)
        fixed = [rng.choice([0.0, rng.uniform(0, 20)]) for _ in range(stages)]
        per = [rng.uniform(0.1, 5) for _ in range(stages)]
        caps = [rng.randint(1, num_layers) for _ in range(stages)]
        if sum(caps) < num_layers:
            with pytest.raises(ValueError, match="cannot place"):
                split_by_speed(num_layers, fixed, per, caps)
            continue
        split = split_by_speed(num_layers, fixed, per, caps)
        assert split[0][0] == 0 and split[-1][1] == num_layers  # every layer placed once, in order
        assert all(a < b for a, b in split) and all(split[i][1] == split[i + 1][0] for i in range(stages - 1))
        assert all(b - a <= c for (a, b), c in zip(split, caps, strict=True))
        got = max(predicted_ms(split, fixed, per))
        assert got == pytest.approx(_brute_force_best(num_layers, fixed, per, caps))


def test_split_by_speed_moves_layers_off_the_stage_with_the_head() -> None:
    # SmolLM2-like: 30 equal layers; the last stage also runs the LM head (a third of its time at 15 layers).
    assert split_by_speed(30, [0.0, 8.0], [1.0, 1.0]) == [(0, 19), (19, 30)]
    assert split_by_speed(30, [0.0, 8.0], [1.0, 1.0], caps=[16, 30]) == [(0, 16), (16, 30)]  # memory wins
    with pytest.raises(ValueError, match="one fixed cost"):
        split_by_speed(4, [0.0], [1.0, 1.0])


def test_counts_and_ranges_convert_both_ways() -> None:
    assert layer_ranges([18, 12]) == [(0, 18), (18, 30)] and layer_counts([(0, 18), (18, 30)]) == [18, 12]
    assert format_split([(0, 18), (18, 30)]) == "18,12" and parse_split("18,12", 30, 2) == [(0, 18), (18, 30)]
    assert predicted_ms([(0, 2), (2, 5)], [1.0, 0.0], [2.0, 1.0]) == [5.0, 3.0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("18;12", "expected layer counts per stage like 18,12, got '18;12'"),
        ("", "expected layer counts per stage like 18,12, got ''"),
        ("20,20", "need 2 counts >= 1 (one per stage) adding up to the model's 30 layers, got '20,20'"),
        ("30,0", "need 2 counts >= 1 (one per stage) adding up to the model's 30 layers, got '30,0'"),
        ("10,10,10", "need 2 counts >= 1 (one per stage) adding up to the model's 30 layers, got '10,10,10'"),
    ],
)
def test_parse_split_says_what_it_expected(text: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_split(text, 30, 2)
    assert str(e.value) == message


def test_check_split_names_the_first_bad_stage() -> None:
    check_split([(0, 18), (18, 30)], 30, 2)
    with pytest.raises(ValueError, match=r"stage 1: layer range \[19, 30\) must start at 18 and be non-empty"):
        check_split([(0, 18), (19, 30)], 30, 2)
    with pytest.raises(ValueError, match=r"stage 0: layer range \[0, 0\) must start at 0 and be non-empty"):
        check_split([(0, 0), (0, 30)], 30, 2)
    with pytest.raises(ValueError, match=r"a split of 30 layers over 3 stages, got \[\(0, 18\), \(18, 30\)\]"):
        check_split([(0, 18), (18, 30)], 30, 3)
    with pytest.raises(ValueError, match="a split of 31 layers over 2 stages"):
        check_split([(0, 18), (18, 30)], 31, 2)
