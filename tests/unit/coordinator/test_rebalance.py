"""Which slot a faster spare should take, if any (coordinator/rebalance.py), and the registry making that move
make-before-break, at most one per interval, with the KV cache sent along."""

from __future__ import annotations

from coordinator.rebalance import Move, Speed, best_move, bottleneck, effective
from coordinator.registry import Device, HeartbeatReport, Load, Registration, Registry
from shardmesh.core.topology import ShardState, WorkerState
from tests.unit.coordinator.test_registry import LIMITS, MODEL, Clock, _beat

SPLIT = ((0, 2), (2, 4))


def test_measured_speeds_of_one_class_are_equal_and_declared_ones_stand() -> None:
    speeds = {"a": Speed(80, "cpu:cpu/2threads"), "b": Speed(120, "cpu:cpu/2threads"), "c": Speed(500, ""),
              "d": Speed(0, "")}  # fmt: skip
    assert effective(speeds) == {"a": 120, "b": 120, "c": 500, "d": 0}
    # Noise between identical machines never moves anything, however large.
    assert best_move(SPLIT, ("a", "b"), 1, speeds | {"e": Speed(300, "cpu:cpu/2threads")}, ["e"], None, {}, 1.3) \
        is None  # fmt: skip


def test_the_move_with_the_largest_gain_wins_and_only_above_the_threshold() -> None:
    speeds = {"a": Speed(100), "b": Speed(50), "fast": Speed(400), "bit": Speed(60)}
    assert bottleneck(SPLIT, ("a", "b"), 1, effective(speeds)) == 2 / 50
    # "fast" in stage 1 makes stage 0 the bottleneck: 2/50 -> 2/100, a 2x gain; in stage 0 it gains nothing.
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["bit", "fast"], None, {}, 1.3) == Move(1, "b", "fast", 2.0)
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["bit"], None, {}, 1.3) is None  # 60/50 = 1.2x: not worth it
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["bit"], None, {}, 1.1) == Move(1, "b", "bit", 1.2)
    # Labels rule: a spare may only take a slot whose requirements it has.
    requires = ((), (("node", "x"),))
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["fast"], requires, {}, 1.3) is None
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["fast"], requires, {"fast": (("node", "x"),)}, 1.3) is not None
    # A holder of unknown speed: nothing to compare with.
    assert best_move(SPLIT, ("a", "b"), 1, speeds | {"b": Speed()}, ["fast"], None, {}, 1.3) is None


def test_a_stage_runs_at_its_slowest_tensor_parallel_shard() -> None:
    speeds = effective({"a0": Speed(100), "a1": Speed(100), "b0": Speed(100), "b1": Speed(25), "f": Speed(200)})
    assert bottleneck(SPLIT, ("a0", "a1", "b0", "b1"), 2, speeds) == 2 / 25
    assert best_move(SPLIT, ("a0", "a1", "b0", "b1"), 2, {k: Speed(v) for k, v in speeds.items()}, ["f"], None, {},
                     1.3) == Move(3, "b1", "f", 4.0)  # fmt: skip


def _register(reg: Registry, worker_id: str, gflops: float) -> None:
    reg.register(Registration(f"10.0.0.{len(reg.workers())}:7000", Device("cpu", "cpu", 1 << 30), (),
                              worker_id, speed=Speed(gflops)))  # fmt: skip


def test_the_registry_moves_a_slot_onto_a_faster_spare_make_before_break_and_then_rests() -> None:
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=1, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, rebalance_gain=1.3, rebalance_interval=30.0)  # fmt: skip
    _register(reg, "w0", 100)
    _register(reg, "w1", 50)
    _register(reg, "fast", 1000)
    assert reg.store.current().worker("fast").preparing_rank == 0  # type: ignore[union-attr]  # not serving yet
    for w in ("w0", "w1"):
        _beat(reg, w)
    reg.expire()
    # Stage 1 (w1, 50 GFLOP/s) is the bottleneck: "fast" loads it while w1 serves, a 2x faster pipeline.
    t = reg.store.current()
    assert t.worker("fast").preparing_rank == 1 and t.find("w1") is not None  # type: ignore[union-attr]
    assert "take it over from w1: a 2.00x faster pipeline" in t.worker("fast").detail  # type: ignore[union-attr]
    reg.heartbeat(HeartbeatReport("fast", ShardState.PENDING, 0, Load(), prepared_rank=1))
    t = reg.store.current()
    assert t.find("fast")[1].rank == 1 and t.find("fast")[1].kv_from == "w1"  # type: ignore[index]
    assert t.worker("w1").state is WorkerState.SPARE and reg.changes["rebalance"] == 1  # type: ignore[union-attr]
    for w in ("fast", "w0"):
        _beat(reg, w)
    # Stage 0 (w0, 100) is the bottleneck now, and another fast worker joins: it waits out the interval.
    _register(reg, "third", 1000)
    assert reg.store.current().worker("third").detail == ""  # type: ignore[union-attr]
    clock.now += 31.0
    for w in ("fast", "w0", "w1", "third"):
        _beat(reg, w)
    reg.expire()
    assert "take it over from w0: a 10.00x" in reg.store.current().worker("third").detail  # type: ignore[union-attr]


def test_a_move_is_given_up_when_its_spare_is_needed_for_a_lost_slot() -> None:
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=1, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, rebalance_gain=1.3)  # fmt: skip
    _register(reg, "w0", 100)
    _register(reg, "w1", 50)
    for w in ("w0", "w1"):
        _beat(reg, w)
    _register(reg, "fast", 1000)
    assert "take it over from w1" in reg.store.current().worker("fast").detail  # type: ignore[union-attr]
    reg.report_lost(["w0"], "killed")  # more urgent: the spare takes the lost slot instead
    t = reg.store.current()
    assert t.find("fast")[1].rank == 0 and t.find("w1")[1].rank == 1  # type: ignore[index]
    assert t.worker("fast").detail == "" and t.find("fast")[1].kv_from == ""  # type: ignore[union-attr,index]


def test_a_faster_spare_without_the_memory_for_the_slot_is_not_moved_onto() -> None:
    speeds = {"a": Speed(100), "b": Speed(50), "small": Speed(400)}
    roomy = best_move(SPLIT, ("a", "b"), 1, speeds, ["small"], None, {}, 1.3, lambda slots: True)
    assert roomy == Move(1, "b", "small", 2.0)
    assert best_move(SPLIT, ("a", "b"), 1, speeds, ["small"], None, {}, 1.3, lambda slots: "small" not in slots) \
        is None  # fmt: skip


def test_the_registry_asks_the_planners_memory_model_before_a_move() -> None:
    asked: list[tuple] = []

    def check(pp: int, split: tuple, memory: list[int], kinds: list[str]) -> str:
        asked.append((pp, split, memory))
        return "stage 1 needs 2 GiB" if memory[1] < (1 << 30) else ""

    reg = Registry(model=MODEL, pp=2, tp=1, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=Clock(), memory_check=check, rebalance_gain=1.3)  # fmt: skip
    _register(reg, "w0", 100)
    _register(reg, "w1", 50)
    for w in ("w0", "w1"):
        _beat(reg, w)
    reg.register(Registration("10.0.0.7:7000", Device("cpu", "cpu", 1 << 20), (), "tiny", speed=Speed(1000)))
    assert asked and asked[-1][2] == [1 << 30, 1 << 20]  # the spare's memory in the slot it would take
    assert reg.store.current().worker("tiny").detail == ""  # type: ignore[union-attr]  # too small: not moved onto
