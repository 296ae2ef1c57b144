"""The arithmetic bench/stage_boundary.py reports from: each cycle's boundary and its split into the stages' compute
and the rest, the layouts it starts, and the positions a run fills."""

from __future__ import annotations

import argparse

import pytest

from bench.stage_boundary import PROMPT, STEPS, context, derived, layouts_of


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


def test_the_layouts_add_a_pipeline_per_spin_count() -> None:
    a = argparse.Namespace(spincount="10000", spin_variants=["1000"])
    assert layouts_of(a) == {"pp=1": (1, "auto", "10000"), "pp=2 shm": (2, "shm", "10000"),
                             "pp=2 gloo": (2, "gloo", "10000"), "pp=2 shm spin=1000": (2, "shm", "1000")}  # fmt: skip


def test_a_run_has_room_for_every_cycle() -> None:
    assert context(40) == len(PROMPT) + 41 * STEPS
