"""The registry with a fake clock: filling slots, publishing versions, timeouts, restarts and standbys, the
balance check's bookkeeping per epoch, label requirements, and requests refused by field."""

from __future__ import annotations

import pytest

from coordinator.registry import Device, HeartbeatReport, Load, Registration, Registry
from shardmesh.core.errors import InvalidArgument, NotFound
from shardmesh.core.topology import Calibration, CalibrationStatus, ModelSpec, ServingLimits, ShardState, Topology
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
    assert spare_topo.find(spare) is None and spare_topo.version == 5  # a standby changes nothing

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


def test_registry_timeout_recovery_restart_and_standby(registry: tuple[Registry, Clock]) -> None:
    reg, clock = registry
    ids = [reg.register(_reg(f"10.0.0.{i}:7000", f"w{i}"))[0] for i in range(4)]
    reg.register(_reg("10.0.0.9:7000", "spare"))
    epoch = reg.store.current().version
    for w in ids:
        _beat(reg, w)
    assert reg.store.current().complete

    clock.now += 2.0
    for w in [*ids[:3], "spare"]:
        _beat(reg, w)
    clock.now += 2.0  # w3 silent for 4 s > 3 s
    assert reg.expire() == ["w3"]
    sick = reg.store.current()
    assert not sick.complete and _states(sick)[3] == "w3:unhealthy"
    assert sick.rendezvous is not None and sick.rendezvous.epoch == epoch  # it keeps its slot
    assert reg.expire() == []  # reported once

    _beat(reg, "w3")  # it was only slow: same process, same groups
    assert reg.store.current().complete and reg.store.current().rendezvous.epoch == epoch  # type: ignore[union-attr]

    _, restarted = reg.register(_reg("10.0.0.3:7001", "w3"))  # restarted on a new port: takes its slot back
    assert restarted.find("w3")[1].rank == 3  # type: ignore[index]
    assert restarted.find("w3")[1].address == "10.0.0.3:7001"  # type: ignore[index]
    assert restarted.rendezvous is not None and restarted.rendezvous.epoch == restarted.version > epoch
    assert _states(restarted) == ["w0:pending", "w1:pending", "w2:pending", "w3:pending"]  # all must rejoin

    version = reg.deregister("w1")
    refilled = reg.store.current()
    assert refilled.version == version and refilled.find("spare")[1].rank == 1  # type: ignore[index]
    assert refilled.rendezvous is not None and refilled.rendezvous.epoch == version

    clock.now += 10.0  # everyone silent; slot holders stay (UNHEALTHY)
    assert sorted(reg.expire()) == ["spare", "w0", "w2", "w3"]
    assert {sh.state for _, sh in reg.store.current().shards()} == {UNHEALTHY}


def test_registry_forgets_silent_standbys_and_reuses_ids_by_address(registry: tuple[Registry, Clock]) -> None:
    reg, clock = registry
    for i in range(4):
        reg.register(_reg(f"10.0.0.{i}:7000"))
    spare, _ = reg.register(_reg("10.0.0.9:7000"))
    assert reg.register(_reg("10.0.0.9:7000"))[0] == spare  # same address, no id: the same worker restarted
    clock.now += 5
    for w in ["worker-0", "worker-1", "worker-2", "worker-3"]:
        _beat(reg, w)
    assert reg.expire() == [spare]
    assert spare not in reg.workers()
    assert _beat(reg, spare) == (False, reg.store.current().version)  # forgotten: told to re-register


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
