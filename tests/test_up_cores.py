"""`shardmesh up` on one host: how the workers share its cores (threads per worker, pipeline depth, OpenMP)."""

from __future__ import annotations

import pytest

from shardmesh_cli.up import TURNS_SPINCOUNT, CoreShare, share_cores


def test_cpu_stages_take_turns_each_on_the_cores_of_its_rank() -> None:
    assert share_cores(2, 1, "cpu", "auto", None, cores=8, env={}) == CoreShare(
        "turns", 8, 1, {"GOMP_SPINCOUNT": TURNS_SPINCOUNT}
    )
    # tensor-parallel ranks of a stage compute at once: they still split the cores
    assert share_cores(3, 2, "cpu", "auto", None, cores=8, env={}).worker_threads == 4
    assert share_cores(2, 3, "cpu", "auto", None, cores=2, env={}).worker_threads == 1


def test_a_full_pipeline_splits_the_cores_among_every_worker() -> None:
    assert share_cores(2, 1, "cpu", "full", None, cores=8, env={}) == CoreShare("full", 4, 0, {})
    assert share_cores(2, 2, "cpu", "full", None, cores=2, env={}).worker_threads == 1
    assert share_cores(2, 1, "cuda", "auto", None, cores=8, env={}).pipeline == "full"  # devices of their own
    assert share_cores(1, 1, "cpu", "auto", None, cores=8, env={}) == CoreShare("full", 8, 0, {})


def test_given_threads_and_openmp_settings_are_kept() -> None:
    assert share_cores(2, 1, "cpu", "turns", 3, cores=8, env={}).worker_threads == 3
    assert share_cores(2, 1, "cpu", "full", 3, cores=8, env={}).worker_threads == 3
    for env in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "active"}):
        assert share_cores(2, 1, "cpu", "auto", None, cores=8, env=env).worker_env == {}


def test_an_unknown_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="--pipeline: must be one of auto, full, turns, got 'half'"):
        share_cores(2, 1, "cpu", "half", None, cores=8, env={})
