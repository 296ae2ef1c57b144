"""bench/sampled_mesh.py's report: each way's medians over the rounds and their ratios to greedy's."""

from __future__ import annotations

import pytest

from bench import sampled_mesh


def test_each_way_is_set_against_greedy_by_its_medians() -> None:
    info = {"cpu": "cpu", "cores": 2, "torch": "2.13.0", "date": "2026-12-01T02:00:00+00:00"}

    def rounds(ms: list[float], tok_s: list[float]) -> list[dict]:
        return [{"ms_per_token": m, "aggregate_tok_s": t} for m, t in zip(ms, tok_s, strict=True)]

    runs = {way: {1: rounds([20.0, 10.0, 12.0], [50.0, 60.0, 55.0]), 16: rounds([30.0] * 3, [400.0] * 3)}
            for way in sampled_mesh.WAYS}  # fmt: skip
    runs["temperature 1"][16] = rounds([33.0, 31.5, 90.0], [360.0, 380.0, 100.0])
    md, rows = sampled_mesh.report(info, "float32", 3, runs)
    by = {(r["way"], r["streams"]): r for r in rows}
    assert by[("greedy", 1)]["ms_per_token"] == 12.0 and by[("greedy", 1)]["ms_ratio"] == 1.0
    assert by[("temperature 1", 16)]["ms_ratio"] == pytest.approx(33.0 / 30.0)  # the median, not the outlier
    assert by[("temperature 1", 16)]["tok_s_ratio"] == pytest.approx(360.0 / 400.0)
    assert "| temperature 1 | 16 | 33.00 | 1.100 | 360.0 | 0.900 |" in md
