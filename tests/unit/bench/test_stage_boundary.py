"""The arithmetic bench/stage_boundary.py reports from: each cycle's boundary and its split into the stages' compute
and the rest, the layouts it starts, and the positions a run fills; and bench/idle_gap.py's table."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import stage_boundary as sb
from bench.stage_boundary import (
    PROMPT,
    STEPS,
    Layout,
    against,
    context,
    derived,
    layouts_of,
    markdown,
    over_pp1,
    seams,
    serial_path,
    topology,
)


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
    assert d["boundary_interval"] is None  # 3 cycles: too few for a 95% interval of the median


def test_the_boundary_has_an_interval_of_its_median_that_says_what_it_tells_of_the_target() -> None:
    base = [20.0] * 8
    got = {"pp=1": {"ms": {"1": base}, "compute_ms": {"1": base}}}
    for name, diffs in [("pp=2 shm", [0.1, 0.3, 0.2, 0.4, 0.0, 0.3, 0.2, 0.1]),
                        ("pp=2 gloo", [0.6, 0.9, 0.7, 1.0, 0.8, 0.6, 0.9, 0.7]),
                        ("pp=2 shm spin=0", [0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.6])]:  # fmt: skip
        got[name] = {"ms": {"1": [b + x for b, x in zip(base, diffs, strict=True)]}, "compute_ms": {"1": base}}
    found = derived(got, [1])
    # 8 cycles: P(B = 0) = 1/256 <= 0.025 < P(B <= 1), so the interval runs from the smallest to the largest.
    assert found["pp=2 shm rows=1"]["boundary_interval"] == (pytest.approx(0.0), pytest.approx(0.4))
    assert sb._interval(found["pp=2 shm rows=1"]["boundary_interval"]) == "+0.00 to +0.40 (at or below 0.5)"
    assert sb._interval(found["pp=2 gloo rows=1"]["boundary_interval"]) == "+0.60 to +1.00 (above 0.5)"
    assert sb._interval(found["pp=2 shm spin=0 rows=1"]["boundary_interval"]) == "+0.10 to +0.90 (holds 0.5)"
    assert sb._interval(None) == "too few cycles"


def test_the_layouts_add_a_pipeline_per_spin_count_a_tp_stage_and_the_layouts_of_another_commit() -> None:
    a = argparse.Namespace(spincount="10000", spin_variants=["1000"], against="", tp=0, tp_threads=0)
    assert layouts_of(a) == {"pp=1": (1, "auto", "10000", "", 1, 0), "pp=2 shm": (2, "shm", "10000", "", 1, 0),
                             "pp=2 gloo": (2, "gloo", "10000", "", 1, 0),
                             "pp=2 shm spin=1000": (2, "shm", "1000", "", 1, 0)}  # fmt: skip
    a.against = "abc123"
    assert list(layouts_of(a).items())[-2:] == [("pp=1 @abc123", (1, "auto", "10000", "abc123", 1, 0)),
                                                ("pp=2 shm @abc123", (2, "shm", "10000", "abc123", 1, 0))]  # fmt: skip
    a.tp, a.tp_threads = 3, 1
    got = layouts_of(a)
    assert got["tp=3"] == Layout(1, "auto", "10000", "", 3, 1) and got["tp=3"].processes == 3
    assert got["tp=3 @abc123"] == Layout(1, "auto", "10000", "abc123", 3, 1)


def test_a_tp_stage_is_held_by_one_worker_per_rank_in_one_rendezvous(tmp_path) -> None:
    from tests.checkpoints import SMOLLM2_CONFIG

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    topo = topology(tmp_path, "float32", 1, 29500, 7, 1, 4, tp=3)
    assert (topo.pp, topo.tp, topo.rendezvous.world_size) == (1, 3, 3)
    assert [(s.tp_rank, s.rank, s.worker_id) for s in topo.stages[0].shards] == [(0, 0, "w0"), (1, 1, "w1"),
                                                                                  (2, 2, "w2")]  # fmt: skip
    pipeline = topology(tmp_path, "float32", 2, 29500, 7, 1, 4)
    assert [[s.worker_id for s in stage.shards] for stage in pipeline.stages] == [["w0"], ["w1"]]


def test_a_tp_layout_is_taken_against_its_own_commits_pp1_within_each_cycle() -> None:
    got = {"pp=1": {"ms": {"1": [20.0, 30.0, 24.0]}}, "tp=3": {"ms": {"1": [30.0, 42.0, 36.0]}},
           "pp=1 @r": {"ms": {"1": [10.0, 10.0, 10.0]}}, "tp=3 @r": {"ms": {"1": [16.0, 15.0, 17.0]}}}  # fmt: skip
    d = over_pp1(got, [1])
    assert d["tp=3 rows=1"]["over_pp1"] == pytest.approx(1.5)  # of 1.5, 1.4, 1.5
    assert d["tp=3 @r rows=1"]["over_pp1"] == pytest.approx(1.6)
    info = {"date": "2026-11-28T05:00:00", "cpu": "cpu", "cores": 2, "torch": "2.13.0", "load_avg_1m": 0.1}
    a = argparse.Namespace(model="m", dtype="bfloat16", spincount="10000", spin_variants=[], against="", tp=3,
                           tp_threads=1, threads=2, cycles=3, compute_priority="realtime")  # fmt: skip
    md = markdown(info, a, {}, None, d)
    assert "| tp=3 | 1 | 24.00 | 36.00 | **1.500×** (" in md and "3 tensor-parallel ranks: 1 each" in md
    assert "compute threads at realtime priority" in md  # as the stage cores ran, which `up` decides


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
                           against_commit="0123456789abcdef", threads=2, cycles=2, tp=0,
                           compute_priority="normal")  # fmt: skip
    md = markdown(info, a, d, c)
    assert "| pp=2 shm @r | 1 | 35.00 | 37.50 | **+2.50** (" in md  # beside its own pp=1
    assert "## This checkout against r (0123456789ab)" in md
    assert "| pp=1 | 1 | 35.00 | 35.00 | **0.995×** (" in md and "| 0.450 | 0.650 | **-0.200** |" in md


def _forwards(start: float, length: float, gap: float) -> list[list[float]]:
    """STEPS forwards of `length` s, `gap` s apart, from `start`."""
    return [[start + k * (length + gap), start + k * (length + gap) + length] for k in range(STEPS)]


def test_the_serial_path_lays_the_stages_forwards_end_to_end() -> None:
    assert serial_path([_forwards(100.0, 0.020, 0.0005)]) == pytest.approx((0.5, 20.0))  # pp=1: its gaps
    # Two stages taking turns: the first's forward k starts 0.3 ms after the last's forward k - 1 ends, the last's
    # 0.2 ms after the first's ends; each token is 8 + 12 ms of forwards and 0.5 ms between them.
    first = [[100.0 + k * 0.0205, 100.0 + k * 0.0205 + 0.008] for k in range(STEPS)]
    last = [[t1 + 0.0002, t1 + 0.0002 + 0.012] for _, t1 in first]
    for k in range(1, STEPS):
        assert first[k][0] - last[k - 1][1] == pytest.approx(0.0003)
    assert serial_path([first, last]) == pytest.approx((0.5, 20.0))
    assert serial_path([first[:-1], last]) is None  # a forward off the CPU decode path: not a call of STEPS


def test_the_seam_is_pp2s_serial_path_less_its_own_commits_pp1s_within_each_cycle() -> None:
    def cycles(*calls: list[list[list[float]]]) -> list[dict]:  # per stage: {"1": [call per cycle]}
        return [{"1": [call[i] for call in calls]} for i in range(len(calls[0]))]

    def pipeline(between_ms: float, forward_ms: float) -> list[list[list[float]]]:
        """Two stages taking turns, each forward half of `forward_ms` and each hand-over half of `between_ms`."""
        t, a, b = 0.0, [], []
        for _ in range(STEPS):
            a.append([t, t + forward_ms / 2e3])
            t += forward_ms / 2e3 + between_ms / 2e3
            b.append([t, t + forward_ms / 2e3])
            t += forward_ms / 2e3 + between_ms / 2e3
        return [a, b]

    got = {
        "pp=1": {"spans": cycles([_forwards(0.0, 0.020, 0.0004)], [_forwards(5.0, 0.030, 0.0006)])},
        "pp=2 shm": {"spans": cycles(pipeline(0.7, 21.0), pipeline(1.0, 31.0))},
        "pp=1 @r": {"spans": cycles([_forwards(9.0, 0.020, 0.0004)], [_forwards(9.5, 0.020, 0.0004)])},
        "pp=2 shm @r": {"spans": cycles(pipeline(0.5, 20.0), pipeline(0.5, 20.0))},
        "pp=2 gloo": {},  # ran off the CPU decode path: no spans, no row
    }
    d = seams(got, [1])
    assert set(d) == {"pp=2 shm rows=1", "pp=2 shm @r rows=1"}
    mine = d["pp=2 shm rows=1"]
    assert mine["seam_ms"] == pytest.approx(0.35)  # of 0.7 - 0.4 and 1.0 - 0.6
    assert mine["forwards_more_ms"] == pytest.approx(1.0)  # of 21 - 20 and 31 - 30
    assert (mine["pp1_between_ms"], mine["pp2_between_ms"]) == (pytest.approx(0.5), pytest.approx(0.85))
    assert d["pp=2 shm @r rows=1"]["seam_ms"] == pytest.approx(0.1)  # against pp=1 @r
    info = {"date": "2026-11-28T05:00:00", "cpu": "cpu", "cores": 2, "torch": "2.13.0", "load_avg_1m": 0.1}
    a = argparse.Namespace(model="m", dtype="float32", spincount="10000", spin_variants=[], against="", tp=0,
                           tp_threads=0, threads=2, cycles=2, compute_priority="normal")  # fmt: skip
    md = markdown(info, a, {}, None, None, d)
    assert "## The seam on the critical path, timestamped" in md
    assert "| pp=2 shm | 1 | 0.500 | 0.850 | **+0.350** (" in md


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
