"""bench/penalised_steps.py's report: each way's median time a token, and its ratios taken within each cycle."""

from __future__ import annotations

import argparse

import pytest

from bench import penalised_steps


def test_each_ratio_is_taken_within_a_cycle_then_the_median_over_cycles() -> None:
    info = {"cpu": "cpu", "cores": 2, "torch": "2.13.0", "date": "2026-12-01T04:00:00+00:00"}
    a = argparse.Namespace(dtype="float32", prompt_tokens=300, cycles=4, ask="penalties")
    # The host slows down in the last two cycles: every way with it. Per cycle, one call is 1.0x no penalty and the
    # per-step way 1.1x, whatever the drift; the medians of the times alone would mix the cycles.
    got = {16: {"no penalty": [50.0, 52.0, 70.0, 72.0], "penalised, one call": [50.0, 52.0, 70.0, 72.0],
                "penalised, per step": [55.0, 57.2, 77.0, 79.2]}}  # fmt: skip
    md, rows = penalised_steps.report(info, a, got)
    assert rows["16/penalised, per step"]["over_no_penalty"][1] == pytest.approx(1.1)
    assert rows["16/penalised, one call"]["over_per_step"][1] == pytest.approx(1 / 1.1)
    assert rows["16/no penalty"]["ms_per_token"] == 61.0
    assert "| 16 | penalised, per step | 67.10 | 1.100 [1.100, 1.100] | 1.000 [1.000, 1.000] |" in md


def test_calls_asking_for_alternatives_are_named_so() -> None:
    """`--ask alternatives`: the same ratios, the ways and the request named for alternatives instead of penalties."""
    info = {"cpu": "cpu", "cores": 2, "torch": "2.13.0", "date": "2026-12-01T04:00:00+00:00"}
    a = argparse.Namespace(dtype="bfloat16", prompt_tokens=300, cycles=4, ask="alternatives")
    got = {1: {"no alternatives": [10.0, 10.0, 12.0, 12.0], "alternatives, one call": [10.0, 10.2, 12.0, 12.24],
               "alternatives, per step": [11.0, 11.0, 13.2, 13.2]}}  # fmt: skip
    md, rows = penalised_steps.report(info, a, got)
    assert rows["1/alternatives, per step"]["over_no_penalty"][1] == pytest.approx(1.1)
    assert "## Decode calls asking for alternatives" in md and "5 top log-probabilities a token" in md
    assert "| rows | way | ms per token | ÷ no alternatives [quartiles] | ÷ alternatives, per step [quartiles] |" in md
