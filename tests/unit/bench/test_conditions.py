"""bench/conditions.py's child runner: what a child prints last comes back as JSON, with the environment asked for and
this checkout importable; a failing child ends the bench naming it, with its stderr."""

from __future__ import annotations

import sys

import pytest

from bench.conditions import ROOT, alternated, child_json

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
