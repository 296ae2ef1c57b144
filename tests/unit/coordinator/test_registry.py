"""The registry with a fake clock: filling slots, publishing versions, timeouts, restarts and standbys, the
balance check's bookkeeping per epoch, label requirements, and requests refused by field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.registry import LOST_RETENTION, Device, HeartbeatReport, Load, Registration, Registry
from shardmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound
from shardmesh.core.topology import (
    Calibration,
    CalibrationStatus,
    HeldShard,
    ModelSpec,
    ServingLimits,
    ShardState,
    Topology,
    WorkerState,
)
from shardmesh.proto.v1 import common_pb2, coordinator_pb2

MODEL = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)
LIMITS = ServingLimits(kv_slots=4, max_context=128, max_batch_tokens=128)
PENDING, LOADING, READY, UNHEALTHY = ShardState.PENDING, ShardState.LOADING, ShardState.READY, ShardState.UNHEALTHY


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _reg(address: str, worker_id: str | None = None) -> Registration:
    return Registration(address, Device("cpu", "cpu", 1 << 30), (("node_group", "a"),), worker_id)


def _beat(registry: Registry, worker_id: str, state: ShardState = READY, applied: int | None = None):
    version = registry.store.current().version if applied is None else applied
    return registry.heartbeat(HeartbeatReport(worker_id, state, version, Load()))


def _fill(registry: Registry, ready: bool = False) -> None:
    """Workers w0..w3 in the four slots of the `registry` fixture's pp=2 tp=2 mesh; READY in its epoch if `ready`."""
    for i in range(4):
        registry.register(_reg(f"10.0.0.{i}:7000", f"w{i}"))
    for i in range(4 if ready else 0):
        _beat(registry, f"w{i}")


def _states(topo: Topology) -> list[str]:
    return [f"{sh.worker_id or '-'}:{sh.state.value}" for _, sh in topo.shards()]


@pytest.fixture
def registry() -> tuple[Registry, Clock]:
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock)  # fmt: skip
    return reg, clock


def test_registry_fills_publishes_and_completes(registry: tuple[Registry, Clock]) -> None:
    reg, _ = registry
    assert reg.store.current().version == 1 and reg.store.current().rendezvous is None
    ids = [reg.register(_reg(f"10.0.0.{i}:7000"))[0] for i in range(4)]
    assert ids == ["worker-0", "worker-1", "worker-2", "worker-3"]
    topo = reg.store.current()
    assert topo.version == 5  # one version per registration that changed the placement
    assert topo.rendezvous is not None and topo.rendezvous.epoch == 5 and topo.rendezvous.prefix == "topo/v5"
    assert [sh.worker_id for _, sh in topo.shards()] == ids
    spare, spare_topo = reg.register(_reg("10.0.0.9:7000"))
    assert spare_topo.find(spare) is None and spare_topo.rendezvous == topo.rendezvous  # a spare moves nobody
    assert [(w.worker_id, w.state, w.rank) for w in spare_topo.workers][-2:] == [
        ("worker-3", WorkerState.LOADING, 3),
        (spare, WorkerState.SPARE, None),
    ]  # listed all the same

    _beat(reg, "worker-0", LOADING)
    assert _states(reg.store.current())[0] == "worker-0:loading"
    for w in ids:
        _beat(reg, w, READY, applied=5)
    done = reg.store.current()
    assert done.complete and done.rendezvous == topo.rendezvous  # state changes keep the groups
    version = done.version
    for w in ids:  # steady heartbeats publish nothing new
        _beat(reg, w)
    assert reg.store.current().version == version


def test_registry_timeout_recovery_and_restart_without_a_spare(registry: tuple[Registry, Clock]) -> None:
    reg, clock = registry
    ids = [reg.register(_reg(f"10.0.0.{i}:7000", f"w{i}"))[0] for i in range(4)]
    epoch = reg.store.current().version
    for w in ids:
        _beat(reg, w)
    assert reg.store.current().complete

    clock.now += 2.0
    for w in ids[:3]:
        _beat(reg, w)
    clock.now += 2.0  # w3 silent for 4 s > 3 s
    assert reg.expire() == ["w3"]
    sick = reg.store.current()
    assert not sick.complete and _states(sick)[3] == "w3:unhealthy"
    assert sick.rendezvous is not None and sick.rendezvous.epoch == epoch  # no spare: it keeps its slot
    assert sick.worker("w3").state is WorkerState.LOST and "no heartbeat" in sick.worker("w3").detail  # type: ignore[union-attr]
    assert reg.expire() == []  # reported once

    _beat(reg, "w3")  # it was only slow: same process, same groups
    back = reg.store.current()
    assert back.complete and back.rendezvous.epoch == epoch and back.worker("w3").detail == ""  # type: ignore[union-attr]

    _, restarted = reg.register(_reg("10.0.0.3:7001", "w3"))  # restarted on a new port: takes its slot back
    assert restarted.find("w3")[1].rank == 3  # type: ignore[index]
    assert restarted.find("w3")[1].address == "10.0.0.3:7001"  # type: ignore[index]
    assert restarted.rendezvous is not None and restarted.rendezvous.epoch == restarted.version > epoch
    assert _states(restarted) == ["w0:pending", "w1:pending", "w2:pending", "w3:pending"]  # all must rejoin
    assert reg.changes == {"join": 2}

    clock.now += 10.0  # everyone silent; slot holders stay (UNHEALTHY)
    assert sorted(reg.expire()) == ["w0", "w1", "w2", "w3"]
    assert {sh.state for _, sh in reg.store.current().shards()} == {UNHEALTHY}


def test_a_spare_takes_the_slot_of_a_lost_worker_at_once(registry: tuple[Registry, Clock]) -> None:
    reg, clock = registry
    ids = [reg.register(_reg(f"10.0.0.{i}:7000", f"w{i}"))[0] for i in range(4)]
    reg.register(_reg("10.0.0.9:7000", "spare"))
    epoch = reg.store.current().rendezvous.epoch  # type: ignore[union-attr]
    clock.now += 2.0
    for w in [*ids[:3], "spare"]:
        _beat(reg, w)
    clock.now += 2.0
    assert reg.expire() == ["w3"]
    t = reg.store.current()
    assert t.find("spare")[1].rank == 3 and t.find("w3") is None  # type: ignore[index]
    assert t.rendezvous is not None and t.rendezvous.epoch > epoch
    assert t.worker("w3").state is WorkerState.LOST  # type: ignore[union-attr]

    _beat(reg, "w3")  # back after all, or restarted under its id: the spare keeps the slot, w3 is the spare now
    _, again = reg.register(_reg("10.0.0.3:7001", "w3"))
    assert again.find("spare")[1].rank == 3 and again.worker("w3").state is WorkerState.SPARE  # type: ignore[index,union-attr]
    assert again.rendezvous == t.rendezvous

    lost, version = reg.report_lost(["w1", "ghost"], "step failed")  # a gateway saw w1 fail; the probe agreed
    after = reg.store.current()
    assert lost == ["w1"] and after.version == version and after.find("w3")[1].rank == 1  # type: ignore[index]
    assert after.worker("w1").state is WorkerState.LOST and after.worker("w1").detail == "step failed"  # type: ignore[union-attr]
    assert reg.report_lost(["w1"], "again")[0] == []  # already lost
    assert reg.changes == {"join": 1, "lost": 2}


def test_drain_hands_the_slot_to_a_spare_or_waits_for_one(registry: tuple[Registry, Clock]) -> None:
    reg, _ = registry
    _fill(reg)
    state, detail, _ = reg.drain("w2")
    assert state is WorkerState.DRAINING and "waiting for a spare to take stage 1 tp rank 0" in detail
    assert reg.store.current().find("w2") is not None  # no spare: it keeps serving

    reg.register(_reg("10.0.0.9:7000", "spare"))  # a spare arrives: it loads the slot's weights first
    t = reg.store.current()
    assert t.worker("spare").preparing_rank == 2 and t.find("w2") is not None  # type: ignore[union-attr]
    assert "serving until spare has loaded stage 1 tp rank 0" in t.worker("w2").detail  # type: ignore[union-attr]
    reg.heartbeat(HeartbeatReport("spare", PENDING, 0, Load(), prepared_rank=2))  # loaded: make, then break
    t = reg.store.current()
    assert t.find("spare")[1].rank == 2 and t.find("w2") is None  # type: ignore[index]
    assert reg.changes["drain"] == 1  # the new epoch is counted as the drain's
    assert t.worker("w2").state is WorkerState.DRAINING and "exiting" in t.worker("w2").detail  # type: ignore[union-attr]
    reg.deregister("w2")  # what the drained worker does on its way out
    assert reg.store.current().worker("w2") is None

    reg.register(_reg("10.0.0.8:7000", "s2"))
    assert reg.drain("s2")[0] is WorkerState.DRAINING  # a spare drains at once: it holds nothing
    assert reg.store.current().find("s2") is None
    with pytest.raises(NotFound, match="worker_id"):
        reg.drain("ghost")


def test_lost_spares_are_listed_then_forgotten_and_ids_reused_by_address(registry: tuple[Registry, Clock]) -> None:
    reg, clock = registry
    for i in range(4):
        reg.register(_reg(f"10.0.0.{i}:7000"))
    spare, _ = reg.register(_reg("10.0.0.9:7000"))
    assert reg.register(_reg("10.0.0.9:7000"))[0] == spare  # same address, no id: the same worker restarted
    clock.now += 5
    for w in ["worker-0", "worker-1", "worker-2", "worker-3"]:
        _beat(reg, w)
    assert reg.expire() == [spare]
    assert reg.store.current().worker(spare).state is WorkerState.LOST  # type: ignore[union-attr]
    clock.now += LOST_RETENTION * 3.0 + 1
    for w in ["worker-0", "worker-1", "worker-2", "worker-3"]:
        _beat(reg, w)
    reg.expire()
    assert spare not in reg.workers()
    assert _beat(reg, spare) == (False, reg.store.current().version)  # forgotten: told to re-register


def _claim(i: int, epoch: int, served: bool = True) -> Registration:
    held = HeldShard(epoch, i, 2, 2, 0 if i < 2 else 2, 2 if i < 2 else 4, served)
    return replace(_reg(f"10.0.0.{i}:7000", f"w{i}"), held=held, last_version=40, pid=1000 + i)


def test_a_restarted_coordinator_adopts_the_placement_the_workers_claim() -> None:
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, recovery_grace=6.0)  # fmt: skip
    assert not reg.settled.is_set()
    reg.register(_reg("10.0.0.9:7000", "newcomer"))  # registers first: it steps back for the claimant of its slot
    for i in (3, 1, 0, 2):  # in any order: each goes back to the rank it held
        reg.register(_claim(i, epoch=37))
    t = reg.store.current()
    assert [sh.worker_id for _, sh in t.shards()] == ["w0", "w1", "w2", "w3"]
    assert t.rendezvous is not None and t.rendezvous.epoch == 37 and t.version > 40  # versions never go back
    assert t.calibration.status is CalibrationStatus.CARRIED_OVER and t.calibration.passed
    assert t.worker("newcomer").state is WorkerState.SPARE and t.worker("w0").pid == 1000  # type: ignore[union-attr]
    assert reg.settled.is_set() and t.serving  # no reload, no new groups, no balance check: serving at once


def test_recovery_gives_up_on_claims_after_the_grace() -> None:
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, recovery_grace=6.0)  # fmt: skip
    for i in (0, 1, 2):
        reg.register(_claim(i, epoch=37, served=False))
    reg.register(_reg("10.0.0.9:7000", "newcomer"))
    assert reg.store.current().find("newcomer") is None  # rank 3 waits for w3
    clock.now += 5.0
    for w in ["w0", "w1", "w2", "newcomer"]:
        _beat(reg, w, PENDING, applied=0)
    clock.now += 1.5
    reg.expire()
    t = reg.store.current()
    assert reg.settled.is_set() and t.find("newcomer")[1].rank == 3  # type: ignore[index]
    assert t.rendezvous is not None and t.rendezvous.epoch != 37  # a new placement: new groups
    assert t.calibration.status is CalibrationStatus.PENDING


def test_claims_that_do_not_fit_this_placement_are_ignored() -> None:
    reg = Registry(model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=Clock(), recovery_grace=6.0)  # fmt: skip
    wrong = replace(_claim(3, 37), held=HeldShard(37, 3, 2, 2, 1, 4))  # another layer split
    reg.register(wrong)
    assert reg.store.current().find("w3") is None


def test_registry_refusals(registry: tuple[Registry, Clock]) -> None:
    reg, _ = registry
    with pytest.raises(NotFound, match="worker_id"):
        reg.deregister("ghost")
    wid, _ = reg.register(_reg("10.0.0.1:7000"))
    with pytest.raises(InvalidArgument, match="applied_topology_version"):
        _beat(reg, wid, READY, applied=999)


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"address": "nohost"}, "address"),
        ({"address": "10.0.0.1:0"}, "address"),
        ({"address": "::1:5000"}, "address"),
        ({"device": None}, "device"),
        ({"device": common_pb2.Device()}, "device.type"),
        ({"worker_id": "bad id!"}, "worker_id"),
        ({"labels": {"bad key": "x"}}, "labels"),
    ],
)
def test_register_request_validation_names_the_field(request_kwargs: dict, field: str) -> None:
    kwargs = {"address": "[::1]:5000", "device": common_pb2.Device(type=common_pb2.DEVICE_TYPE_CPU), **request_kwargs}
    if kwargs["device"] is None:
        del kwargs["device"]
    with pytest.raises(InvalidArgument) as e:
        Registration.from_pb(coordinator_pb2.RegisterRequest(**kwargs))
    assert e.value.field_name.startswith(field)


def test_heartbeat_request_validation() -> None:
    with pytest.raises(InvalidArgument, match=r"^state:"):
        HeartbeatReport.from_pb(coordinator_pb2.HeartbeatRequest(worker_id="w0"))
    with pytest.raises(InvalidArgument, match=r"^worker_id:"):
        HeartbeatReport.from_pb(coordinator_pb2.HeartbeatRequest(state=common_pb2.SHARD_STATE_READY))


# -- the balance check's bookkeeping ------------------------------------------------------------------

SIX_LAYERS = ModelSpec("/m", "float32", "LlamaForCausalLM", 6, 64, 32000, 256)
SIX_LAYER_LIMITS = ServingLimits(4, 256, 256)


def _ready_registry(**kw: object) -> tuple[Registry, list[str]]:
    reg = Registry(model=SIX_LAYERS, pp=2, tp=1, limits=SIX_LAYER_LIMITS, store_host="127.0.0.1", store_port=1,
                   heartbeat_timeout=5, **kw)  # type: ignore[arg-type]  # fmt: skip
    ids = [reg.register(Registration(f"127.0.0.1:{5000 + i}", Device("cpu", "cpu", 2**30),
                                     (("node", "A" if i == 0 else "B"),)))[0] for i in range(2)]  # fmt: skip
    return reg, ids


def _ready(reg: Registry, ids: list[str]) -> Topology:
    for w in ids:
        reg.heartbeat(HeartbeatReport(w, ShardState.READY, reg.store.current().rendezvous.epoch, Load()))  # type: ignore[union-attr]
    t = reg.store.current()
    assert t.complete
    return t


def test_registry_publishes_calibration_per_epoch_and_resplits() -> None:
    reg, ids = _ready_registry(split=((0, 4), (4, 6)))
    t = _ready(reg, ids)
    assert [(s.layer_start, s.layer_end) for s in t.stages] == [(0, 4), (4, 6)]
    assert t.calibration.status is CalibrationStatus.PENDING and not t.serving
    epoch = t.rendezvous.epoch  # type: ignore[union-attr]
    assert not reg.record_calibration(Calibration(CalibrationStatus.BALANCED, epoch + 100, True))  # another epoch
    assert reg.record_calibration(Calibration(CalibrationStatus.BALANCED, epoch, True, message="fine"))
    served = reg.store.current()
    assert served.serving and served.version > t.version
    moving = Calibration(CalibrationStatus.REBALANCING, epoch, False, message="slow stage 1", rebalances=1)
    after = reg.resplit(((0, 5), (5, 6)), moving)
    assert [(s.layer_start, s.layer_end) for s in after.stages] == [(0, 5), (5, 6)]
    assert after.rendezvous is not None and after.rendezvous.epoch > epoch and not after.complete  # workers reload
    assert after.calibration.status is CalibrationStatus.PENDING and after.calibration.rebalances == 1
    assert f"epoch {epoch}: rebalancing: slow stage 1" in after.calibration.message
    with pytest.raises(ValueError, match="must start at 5"):
        reg.resplit(((0, 5), (6, 6)), moving)


def test_slots_that_require_a_node_wait_for_a_worker_from_it() -> None:
    requires = ((("node", "B"),), (("node", "A"),))  # the plan put rank 0 on node B
    reg, ids = _ready_registry(requires=requires)
    t = reg.store.current()
    assert [sh.worker_id for _, sh in t.shards()] == [ids[1], ids[0]]
    assert [dict(sh.requires) for _, sh in t.shards()] == [{"node": "B"}, {"node": "A"}]
    # The node-B worker comes back with other labels: it loses the slot, and nobody else may take it.
    reg.register(Registration("127.0.0.1:5001", Device("cpu", "cpu", 2**30), (("node", "C"),), ids[1]))
    assert [sh.worker_id for _, sh in reg.store.current().shards()] == ["", ids[0]]


def test_a_passed_check_carries_over_to_a_spare_on_the_same_kind_of_device() -> None:
    reg, ids = _ready_registry()
    t = _ready(reg, ids)
    assert reg.record_calibration(Calibration(CalibrationStatus.BALANCED, t.epoch, True, message="fine"))
    same = Registration("127.0.0.1:5009", Device("cpu", "cpu", 2**30), (("node", "B"),), "spare")
    reg.register(same)
    reg.report_lost([ids[1]], "killed")
    moved = reg.store.current()
    assert moved.find("spare") is not None and moved.epoch > t.epoch
    assert moved.calibration.status is CalibrationStatus.CARRIED_OVER and moved.calibration.epoch == moved.epoch
    assert f"epoch {t.epoch} carried over" in moved.calibration.message
    assert _ready(reg, [ids[0], "spare"]).serving  # no new check: serving as soon as the shards are READY

    other = Registration("127.0.0.1:5010", Device("cuda", "NVIDIA H100", 80 * 2**30), (("node", "A"),), "gpu")
    reg.register(other)
    reg.report_lost([ids[0]], "killed")
    assert reg.store.current().calibration.status is CalibrationStatus.PENDING  # another device: measured again


# -- re-planning onto the workers there are ------------------------------------------------------------------


def _replanning(clock: Clock, fits: bool = True) -> tuple[Registry, list]:
    asked: list = []

    def check(pp: int, split: tuple, memory: list[int], kinds: list[str]) -> str:
        asked.append((pp, split))
        return "" if fits else f"at pp={pp}, stage 0 needs layers 0-3 but its devices (1 GiB) hold 2"

    reg = Registry(model=MODEL, pp=2, tp=1, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, memory_check=check, replan_after=10.0,
                   regrow_interval=10.0)  # fmt: skip
    for i in range(2):
        reg.register(_reg(f"10.0.0.{i}:7000", f"w{i}"))
    return reg, asked


def test_a_drain_without_a_spare_re_plans_onto_the_survivor_and_a_join_grows_back() -> None:
    clock = Clock()
    reg, asked = _replanning(clock)
    _, detail, _ = reg.drain("w1")
    t = reg.store.current()
    assert (t.pp, [(s.layer_start, s.layer_end) for s in t.stages]) == (1, [(0, 4)]) and asked == [(1, ((0, 4),))]
    assert t.find("w0") is not None and t.find("w1") is None and "exiting" in detail
    assert reg.changes["drain"] == 1
    reg.deregister("w1")

    clock.now += 2.0
    reg.register(_reg("10.0.0.5:7000", "w5"))  # joins: the plan wants 2 stages, but not twice in 10 s
    assert reg.store.current().pp == 1 and reg.store.current().worker("w5").state is WorkerState.SPARE  # type: ignore[union-attr]
    clock.now += 8.5
    for w in ("w0", "w5"):
        _beat(reg, w, PENDING, applied=0)
    reg.expire()
    grown = reg.store.current()
    assert grown.pp == 2 and [sh.worker_id for _, sh in grown.shards()] == ["w0", "w5"]
    assert [(s.layer_start, s.layer_end) for s in grown.stages] == [(0, 2), (2, 4)]


def test_a_lost_worker_gets_replan_after_seconds_to_come_back() -> None:
    clock = Clock()
    reg, _ = _replanning(clock)
    clock.now += 2.0
    _beat(reg, "w0", PENDING, applied=0)
    clock.now += 2.0
    assert reg.expire() == ["w1"]
    assert reg.store.current().pp == 2  # `up` may restart it: not yet
    for _ in range(4):
        clock.now += 3.0
        _beat(reg, "w0", PENDING, applied=0)
        reg.expire()
    t = reg.store.current()
    assert t.pp == 1 and t.find("w0") is not None and t.worker("w1").state is WorkerState.LOST  # type: ignore[union-attr]
    assert reg.changes["replan"] == 1


def test_a_mesh_still_forming_waits_for_its_workers_however_long_they_take() -> None:
    """A slot no worker has taken yet is not a lost one: a second worker that starts slowly (importing torch on a
    busy machine) finds the planned two stages, not a model shrunk onto the first worker."""
    clock = Clock()
    reg = Registry(model=MODEL, pp=2, tp=1, limits=LIMITS, store_host="127.0.0.1", store_port=29500,
                   heartbeat_timeout=3.0, clock=clock, memory_check=lambda *a: "", replan_after=10.0,
                   regrow_interval=10.0)  # fmt: skip
    reg.register(_reg("10.0.0.0:7000", "w0"))
    for _ in range(10):
        clock.now += 2.5
        _beat(reg, "w0", PENDING, applied=0)
        reg.expire()
    assert reg.store.current().pp == 2 and reg.changes["replan"] == 0
    reg.register(_reg("10.0.0.1:7000", "w1"))
    t = reg.store.current()
    assert t.pp == 2 and [sh.worker_id for _, sh in t.shards()] == ["w0", "w1"] and t.epoch is not None


def test_a_drain_with_a_spare_preparing_does_not_re_plan() -> None:
    clock = Clock()
    reg, asked = _replanning(clock)
    reg.register(_reg("10.0.0.5:7000", "spare"))
    reg.drain("w1")
    t = reg.store.current()
    assert t.pp == 2 and asked == [] and t.worker("spare").preparing_rank == 1  # type: ignore[union-attr]


def test_a_drain_waits_when_the_survivors_memory_cannot_hold_the_model() -> None:
    reg, asked = _replanning(Clock(), fits=False)
    state, detail, _ = reg.drain("w1")
    assert state is WorkerState.DRAINING and asked == [(1, ((0, 4),))]
    assert "waiting for a spare" in detail and "hold 2" in detail
    assert reg.store.current().pp == 2 and reg.store.current().find("w1") is not None


def test_a_drain_hands_over_without_the_spare_saying_so_after_a_deadline_and_lost_slots_go_first(
    registry: tuple[Registry, Clock],
) -> None:  # fmt: skip
    reg, clock = registry
    _fill(reg)
    reg.register(_reg("10.0.0.9:7000", "spare"))
    reg.drain("w0")
    assert reg.store.current().worker("spare").preparing_rank == 0  # type: ignore[union-attr]
    lost, _ = reg.report_lost(["w3"], "killed")  # more urgent than the drain: the preparing spare takes it
    t = reg.store.current()
    assert lost == ["w3"] and t.find("spare")[1].rank == 3 and t.find("w0") is not None  # type: ignore[index]
    reg.register(_reg("10.0.0.8:7000", "s2"))
    assert reg.store.current().worker("s2").preparing_rank == 0  # type: ignore[union-attr]
    clock.now += 61.0
    for w in ("w0", "w1", "w2", "spare", "s2"):
        _beat(reg, w, PENDING, applied=0)
    reg.expire()
    assert reg.store.current().find("s2")[1].rank == 0  # type: ignore[index]  # never said so: handed over anyway


def test_idle_spares_load_ranks_ahead_round_robin_and_a_prepared_one_takes_a_lost_slot(
    registry: tuple[Registry, Clock],
) -> None:  # fmt: skip
    reg, _ = registry
    _fill(reg)
    reg.register(_reg("10.0.0.8:7000", "s1"))
    reg.register(_reg("10.0.0.9:7000", "s2"))
    t = reg.store.current()
    assert [t.worker(s).preparing_rank for s in ("s1", "s2")] == [0, 1]  # type: ignore[union-attr]
    assert t.worker("s1").state is WorkerState.SPARE  # type: ignore[union-attr]
    reg.heartbeat(HeartbeatReport("s2", PENDING, 0, Load(), prepared_rank=1))
    reg.report_lost(["w1"], "killed")  # rank 1: the spare that loaded it takes it, not the one registered first
    t = reg.store.current()
    assert t.find("s2")[1].rank == 1 and t.find("s1") is None  # type: ignore[index]
    assert t.worker("s1").preparing_rank == 0  # type: ignore[union-attr]  # keeps its guess
    assert t.find("s2")[1].kv_from == ""  # type: ignore[index]  # a lost worker's cache is gone: replayed


def test_a_drained_holder_is_named_as_its_successors_kv_source_until_the_successor_serves(
    registry: tuple[Registry, Clock],
) -> None:  # fmt: skip
    reg, _ = registry
    _fill(reg, ready=True)
    reg.register(_reg("10.0.0.9:7000", "spare"))
    assert reg.store.current().worker("spare").preparing_rank == 0  # type: ignore[union-attr]  # ahead
    reg.drain("w2")  # the drain's rank comes first: the hot spare loads that one instead
    assert reg.store.current().worker("spare").preparing_rank == 2  # type: ignore[union-attr]
    reg.heartbeat(HeartbeatReport("spare", PENDING, 0, Load(), prepared_rank=2))
    t = reg.store.current()
    assert t.find("spare")[1].rank == 2 and t.find("spare")[1].kv_from == "w2"  # type: ignore[index]
    assert all(sh.kv_from == "" for _, sh in t.shards() if sh.rank != 2)
    _beat(reg, "spare")  # it joined the new epoch, the cache received (or replayed): the source is forgotten
    assert reg.store.current().find("spare")[1].kv_from == ""  # type: ignore[index]


def _on_gpu(address: str, worker_id: str, uuid: str, index: int = 0) -> Registration:
    return Registration(address, Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, uuid, index), (), worker_id)


def test_a_second_live_worker_on_one_gpu_is_refused_by_its_uuid(registry: tuple[Registry, Clock]) -> None:
    """NCCL refuses two ranks on one GPU: the coordinator says so at registration, naming both workers."""
    reg, clock = registry
    reg.register(_on_gpu("10.0.0.1:7000", "worker-0", "GPU-aaaa", 0))
    version = reg.store.current().version
    with pytest.raises(FailedPrecondition) as e:
        reg.register(_on_gpu("10.0.0.2:7000", "worker-1", "GPU-aaaa", 0))
    assert e.value.code == "FAILED_PRECONDITION"
    assert str(e.value) == "device.uuid: worker-1 and worker-0 are both on GPU GPU-aaaa (cuda:0): one GPU per rank"
    assert "worker-1" not in reg.workers() and reg.store.current().version == version  # nothing changed
    with pytest.raises(FailedPrecondition, match=r"\(cuda:2 and cuda:0 in their processes\)"):
        reg.register(_on_gpu("10.0.0.2:7000", "worker-1", "GPU-aaaa", 2))  # another index, the same GPU
    # Another GPU is fine; the same worker re-registering (a restart) keeps its GPU.
    reg.register(_on_gpu("10.0.0.2:7000", "worker-1", "GPU-bbbb", 1))
    reg.register(_on_gpu("10.0.0.1:7000", "worker-0", "GPU-aaaa", 0))
    # A lost worker's GPU is free again: a process that took it over may register.
    clock.now += 10.0
    _beat(reg, "worker-1")
    assert reg.expire() == ["worker-0"]
    reg.register(_on_gpu("10.0.0.3:7000", "worker-2", "GPU-aaaa", 0))
    assert "worker-2" in reg.workers()


def test_cpu_workers_and_workers_without_a_uuid_are_never_refused(registry: tuple[Registry, Clock]) -> None:
    reg, _ = registry
    for i in range(3):
        reg.register(_reg(f"10.0.0.{i}:7000", f"cpu{i}"))
        reg.register(_on_gpu(f"10.0.1.{i}:7000", f"old{i}", ""))  # a build that reports no UUID
    assert len(reg.workers()) == 6


def test_the_uuid_and_index_come_from_the_wire() -> None:
    gpu = common_pb2.Device(type=common_pb2.DEVICE_TYPE_CUDA, name="NVIDIA H100", memory_bytes=2**30, uuid="GPU-aaaa",
                            index=3)  # fmt: skip
    pb = coordinator_pb2.RegisterRequest(address="10.0.0.1:7000", device=gpu)
    device = Registration.from_pb(pb).device
    assert (device.uuid, device.index, device.describe()) == ("GPU-aaaa", 3, "cuda:3")
    pb.device.uuid = "x" * 257
    with pytest.raises(InvalidArgument, match=r"device.uuid: at most 256 characters"):
        Registration.from_pb(pb)
