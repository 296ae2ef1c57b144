"""The arithmetic bench/stage_boundary.py reports from: each cycle's boundary and its split into the stages' compute
and the rest, the layouts it starts, and the positions a run fills; and bench/idle_gap.py's table."""

from __future__ import annotations

import argparse

import pytest

from bench.stage_boundary import PROMPT, STEPS, against, context, derived, layouts_of, markdown


def test_the_boundary_is_split_within_each_cycle() -> None:
    got = {
        "pp=1": {"ms": {"1": [30.0, 40.0, 31.0]}, "compute_ms": {"1": [29.0, 39.0, 30.0]}},
        "pp=2 shm": {"ms": {"1": [31.0, 42.0, 31.5]}, "compute_ms": {"1": [29.5, 40.0, 30.5]}},
    }
    d = derived(got, [1])["pp=2 shm rows=1"]
    assert d["boundary_ms"] == pytest.approx(1.0)  # the median of +1.0, +2.0, +0.5
    assert d["compute_more_ms"] == pytest.approx(0.5)  # of +0.5, +1.0, +0.5
    assert d["rest_ms"] == pytest.approx(0.5)  # of +0.5, +1.0, 0.0: each cycle's boundary less its compute
    assert d["ratio"] == pytest.approx(30.0 / 31.0)  # pp=1's ms over pp=2's, tokens/s the other way round
    assert (d["pp1_ms"], d["pp2_ms"]) == (31.0, 31.5)


def test_the_layouts_add_a_pipeline_per_spin_count_and_two_layouts_of_another_commit() -> None:
    a = argparse.Namespace(spincount="10000", spin_variants=["1000"], against="")
    assert layouts_of(a) == {"pp=1": (1, "auto", "10000", ""), "pp=2 shm": (2, "shm", "10000", ""),
                             "pp=2 gloo": (2, "gloo", "10000", ""),
                             "pp=2 shm spin=1000": (2, "shm", "1000", "")}  # fmt: skip
    a.against = "abc123"
    assert list(layouts_of(a).items())[-2:] == [("pp=1 @abc123", (1, "auto", "10000", "abc123")),
                                                ("pp=2 shm @abc123", (2, "shm", "10000", "abc123"))]  # fmt: skip


def test_another_commits_pipeline_is_taken_against_its_own_pp1_and_set_beside_this_checkouts() -> None:
    def layout(ms: list[float], compute: list[float], around: list[float]) -> dict:
        return {"ms": {"1": ms}, "compute_ms": {"1": compute}, "around_ms": {"1": around}}

    got = {
        "pp=1": layout([30.0, 40.0], [29.0, 39.0], [0.4, 0.5]),
        "pp=2 shm": layout([31.0, 41.0], [29.5, 39.5], [0.5, 0.7]),
        "pp=1 @r": layout([32.0, 38.0], [31.0, 37.0], [0.6, 0.7]),
        "pp=2 shm @r": layout([34.0, 41.0], [32.0, 38.0], [0.9, 1.1]),
    }
    d = derived(got, [1])
    assert set(d) == {"pp=2 shm rows=1", "pp=2 shm @r rows=1"}
    assert d["pp=2 shm @r rows=1"]["boundary_ms"] == pytest.approx(2.5)  # of +2.0 and +3.0, against pp=1 @r
    c = against(got, [1], "r")
    assert c["pp=1 rows=1"]["ms_ratio"] == pytest.approx((30 / 32 + 40 / 38) / 2)  # within each cycle
    assert c["pp=1 rows=1"]["around_diff_ms"] == pytest.approx(-0.2)
    assert c["pp=2 shm rows=1"]["around_diff_ms"] == pytest.approx(-0.4)
    assert c["pp=2 shm rows=1"]["rev_around_ms"] == pytest.approx(1.0)
    info = {"date": "2026-11-28T05:00:00", "cpu": "cpu", "cores": 2, "torch": "2.13.0", "load_avg_1m": 0.1}
    a = argparse.Namespace(model="m", dtype="bfloat16", spincount="10000", spin_variants=[], against="r",
                           against_commit="0123456789abcdef", threads=2, cycles=2)  # fmt: skip
    md = markdown(info, a, d, c)
    assert "| pp=2 shm @r | 1 | 35.00 | 37.50 | **+2.50** (" in md  # beside its own pp=1
    assert "## This checkout against r (0123456789ab)" in md
    assert "| pp=1 | 1 | 35.00 | 35.00 | **0.995×** (" in md and "| 0.450 | 0.650 | **-0.200** |" in md


def test_a_run_has_room_for_every_cycle() -> None:
    assert context(40) == len(PROMPT) + 41 * STEPS


def test_the_idle_gap_table_sets_each_mode_beside_the_other() -> None:
    from bench.idle_gap import MODES, markdown

    info = {"date": "2026-11-27T20:00:00", "cpu": "cpu", "cores": 2, "torch": "2.13.0", "load_avg_1m": 0.1}
    a = argparse.Namespace(model="m", dtype="float32", blocks=2, gap_ms=15.0)
    md = markdown(info, a, {2: {MODES[0]: [30.0, 31.0, 29.0], MODES[1]: [33.0, 30.0, 36.0]}})
    assert "| 2 | 30.00 | 33.00 | **1.100×** (+3.00 ms) |" in md


def test_the_idle_gap_has_room_for_its_blocks_and_no_more() -> None:
    from bench.idle_gap import cycles

    assert context(cycles(30)) == len(PROMPT) + 2 * 30 * STEPS  # two blocks of STEPS one-step calls per pair
