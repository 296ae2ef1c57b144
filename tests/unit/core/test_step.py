"""Step and sampling types: bounds checked once, at construction, and nothing heavier than dataclasses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardmesh.core.step import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
    ],
)
def test_sampling_params_out_of_bounds_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams().greedy and SamplingParams(top_k=5).greedy
    assert not SamplingParams(temperature=0.7, seed=1).greedy


def test_step_types_import_no_torch() -> None:
    code = "import sys, shardmesh.core.step; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
