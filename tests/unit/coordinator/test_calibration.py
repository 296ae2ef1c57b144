"""The balance check on plain values: the verdict with its numbers and the split that fixes it, whether a
re-split is worth it, the refused settings, and pass sizes within what every shard allocated."""

from __future__ import annotations

import pytest

from coordinator.calibration import CalibrationConfig, judge, pass_sizes, speed_split, worth_moving
from coordinator.registry import Device, Registration, Registry
from shardmesh.core.topology import (
    CalibrationStatus,
    ModelSpec,
    ServingLimits,
    ShardCalibration,
    StageCalibration,
    Topology,
)


def _stage(index: int, start: int, end: int, decode: float, layers: float, memory: int = 100) -> StageCalibration:
    shard = ShardCalibration(index, f"w{index}", decode, 2 * decode, memory, memory, 1000, 10, 5)
    return StageCalibration(index, start, end, decode, layers, 2 * decode, (shard,))


def test_judge_reports_the_slow_stage_with_numbers_and_the_split_that_fixes_it() -> None:
    stages = (_stage(0, 0, 15, 15.0, 15.0), _stage(1, 15, 30, 23.0, 15.0))  # stage 1: 8 ms of LM head
    c = judge(4, stages, CalibrationConfig(), 30, 8, 128)
    assert c.status is CalibrationStatus.IMBALANCED and c.passed  # reported, served: balance not required
    assert c.stage_ratio == pytest.approx(23 / 15, abs=1e-4) and c.speed_split == (19, 11)
    assert "stage 1 (layers 15-29) takes 23.00 ms per decode pass of 8, 1.53× stage 0's 15.00 ms" in c.message
    assert "[19, 11] (now [15, 15])" in c.message and "rebalance: by-speed" in c.message
    assert worth_moving(c)
    strict = judge(4, stages, CalibrationConfig(require_balance=True), 30, 8, 128)
    assert strict.status is CalibrationStatus.IMBALANCED and not strict.passed
    loose = judge(4, stages, CalibrationConfig(max_stage_ratio=1.6), 30, 8, 128)
    assert loose.status is CalibrationStatus.BALANCED and loose.passed and "within 1.53×" in loose.message
    # Already at the speed split (or too little to gain): nothing to move.
    even = judge(5, (_stage(0, 0, 19, 19.0, 19.0), _stage(1, 19, 30, 19.0, 11.0)), CalibrationConfig(), 30, 8, 128)
    assert even.status is CalibrationStatus.BALANCED and even.speed_split == (19, 11) and not worth_moving(even)
    one = judge(6, (_stage(0, 0, 30, 30.0, 28.0),), CalibrationConfig(), 30, 8, 128)
    assert one.status is CalibrationStatus.BALANCED and one.stage_ratio == 1.0 and one.speed_split == (30,)
    assert speed_split(stages, 30, caps=[17, 30]) == [17, 13]


def test_calibration_config_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match=r"max_stage_ratio: must be >= 1\.0"):
        CalibrationConfig(max_stage_ratio=0.9)
    with pytest.raises(ValueError, match="rebalance: must be one of none, by-speed"):
        CalibrationConfig(rebalance="by-memory")


def _two_stage_registry() -> Registry:
    reg = Registry(model=ModelSpec("/m", "float32", "LlamaForCausalLM", 6, 64, 32000, 256), pp=2, tp=1,
                   limits=ServingLimits(4, 256, 256), store_host="127.0.0.1", store_port=1,
                   heartbeat_timeout=5)  # fmt: skip
    for i in range(2):
        reg.register(Registration(f"127.0.0.1:{5000 + i}", Device("cpu", "cpu", 2**30)))
    return reg


def test_pass_sizes_stay_within_the_limits() -> None:
    reg = _two_stage_registry()
    t = reg.store.current()
    assert pass_sizes(t, CalibrationConfig()) == (4, 64)  # 4 KV slots
    small = Topology(t.version, t.model, t.pp, t.tp, t.stages, t.rendezvous, t.complete, ServingLimits(2, 32, 16))
    assert pass_sizes(small, CalibrationConfig()) == (2, 16)
