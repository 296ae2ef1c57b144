"""`shardmesh worker --speed`: 'auto' (measured at start) or a declared GFLOP/s figure; anything else is refused
before the worker starts."""

from __future__ import annotations

import pytest

from shardmesh_cli.main import build_parser, main
from shardworker.app import build_config


@pytest.mark.parametrize("value,expected", [("auto", None), ("AUTO", None), ("250", 250.0), ("0.5", 0.5)])
def test_speed_is_measured_or_declared(value: str, expected: float | None) -> None:
    args = build_parser().parse_args(["worker", "--speed", value])
    assert build_config(args).speed_gflops == expected


@pytest.mark.parametrize("value,why", [("fast", "expected 'auto' or GFLOP/s"), ("0", "must be > 0"),
                                       ("-3", "must be > 0"), ("nan", "must be > 0")])  # fmt: skip
def test_a_bad_speed_is_a_usage_error(value: str, why: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--speed", value]) == 2
    assert f"--speed: {why}" in capsys.readouterr().err
