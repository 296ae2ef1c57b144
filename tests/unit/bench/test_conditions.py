"""bench/conditions.py's child runner: what a child prints last comes back as JSON, with the environment asked for and
this checkout importable; a failing child ends the bench naming it, with its stderr."""

from __future__ import annotations

import sys

import pytest

from bench.conditions import ROOT, alternated, child_json, median_interval

CHILD = (
    "import json, os, bench.conditions as c; print('-'); "
    "print(json.dumps([os.environ['WAY'], os.getcwd(), c.__file__]))"
)


def test_a_child_returns_its_last_line_as_json_with_its_environment() -> None:
    way, cwd, bench_file = child_json([sys.executable, "-c", CHILD], {"WAY": "amx"})
    assert way == "amx" and cwd == str(ROOT) and bench_file.startswith(str(ROOT))


def test_a_failing_child_ends_the_bench_with_its_stderr() -> None:
    with pytest.raises(SystemExit) as e:
        child_json([sys.executable, "-c", "import sys; sys.exit('no weights here')"], what="eager float32 child")
    assert "eager float32 child failed (exit status 1)" in str(e.value) and "no weights here" in str(e.value)


def test_rounds_alternate_the_order() -> None:
    assert [alternated(["a", "b", "c"], r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


def test_median_interval_takes_the_order_statistics_binomial_tails_allow() -> None:
    # n = 36: P(B <= 11) = 0.016 <= 0.025 < P(B <= 12) = 0.033, so the 12th smallest and the 12th largest.
    assert median_interval([float(x) for x in range(36, 0, -1)]) == (12.0, 25.0)
    # n = 6: only the extremes (P(B = 0) = 1/64); n = 5: 1/32 > 0.025, so no 95% interval at all.
    assert median_interval([3.0, 1.0, 2.0, 6.0, 5.0, 4.0]) == (1.0, 6.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0], confidence=0.9) == (1.0, 5.0)  # 1/32 <= 0.05
