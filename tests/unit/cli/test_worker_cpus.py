"""`shardmesh worker --cpus`: the CPUs the worker's threads run on (as `shardmesh up` pins tensor-parallel ranks that
outnumber the cores); a list naming a CPU the process may not use, or not a list, is refused before it starts."""

from __future__ import annotations

import re

import pytest

from shardmesh_cli.main import main
from shardworker.app import UsageError, parse_cpus


def test_cpus_are_numbers_and_ranges_the_process_may_use() -> None:
    assert parse_cpus("0", {0, 1}) == {0}
    assert parse_cpus("0,2-3", {0, 1, 2, 3}) == {0, 2, 3}
    with pytest.raises(UsageError, match=r"--cpus: '4' names CPUs this process may not use \(it may use 0,1\)"):
        parse_cpus("4", {0, 1})
    with pytest.raises(UsageError, match=re.escape("--cpus: expected CPU numbers and ranges, e.g. 0,2-3; got 'a'")):
        parse_cpus("a", {0, 1})


def test_a_cpu_out_of_reach_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--cpus", "100000"]) == 2
    assert "--cpus: '100000' names CPUs this process may not use" in capsys.readouterr().err
