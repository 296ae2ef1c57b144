"""The coordinator: placement rules on plain values, the registry with a fake clock, and the real
`shardmesh coordinator` process driven by fake workers over gRPC."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import placement
from coordinator.placement import WorkerView
from coordinator.registry import Device, HeartbeatReport, InvalidArgument, Load, Registration, Registry, UnknownWorker
from coordinator.servicer import SERVICE_NAME
from shardmesh.core.topology import ModelSpec, Rendezvous, ServingLimits, ShardState, Topology, TopologyStore
from shardmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from shardmesh_cli import main as cli
from tests.stack import ServiceProcess

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 128,
}  # fmt: skip
MODEL = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)
LIMITS = ServingLimits(kv_slots=4, max_context=128, max_batch_tokens=128)
PENDING, LOADING, READY, UNHEALTHY = ShardState.PENDING, ShardState.LOADING, ShardState.READY, ShardState.UNHEALTHY


def view(worker_id: str, reported: ShardState = READY, applied: int = 0, timed_out: bool = False, inc: int = 1):
    return WorkerView(worker_id, f"10.0.0.1:{5000 + len(worker_id)}", inc, reported, applied, timed_out)


# -- placement: pure functions ------------------------------------------------------------------------


def test_fill_slots_lowest_rank_first_in_registration_order() -> None:
    assert placement.fill_slots((None,) * 4, ["a", "b", "c", "d", "e"]) == ("a", "b", "c", "d")
    assert placement.fill_slots(("a", None, "c", None), ["a", "e", "c", "f", "g"]) == ("a", "e", "c", "f")
    assert placement.fill_slots(("a", None), []) == ("a", None)
    assert placement.vacate(("a", "b", "a"), "a") == (None, "b", None)


def test_epoch_survives_state_changes_and_changes_with_placement() -> None:
    key = (("a", 1), ("b", 2))
    assert placement.next_epoch(None, None, None, 5) is None  # vacancies: no rendezvous at all
    assert placement.next_epoch(None, None, key, 5) == 5  # first full placement: named after its version
    assert placement.next_epoch(key, 5, key, 9) == 5  # same processes in the same ranks: same groups
    assert placement.next_epoch(key, 5, (("a", 1), ("b", 3)), 9) == 9  # b restarted: new groups


def test_placement_key_needs_every_slot_and_tracks_incarnations_and_the_split() -> None:
    workers = {"a": view("a", inc=3), "b": view("b", inc=4)}
    split = ((0, 2), (2, 4))
    assert placement.placement_key(split, ("a", None), workers) is None
    key = placement.placement_key(split, ("b", "a"), workers)
    assert key == (split, (("b", 4), ("a", 3)))
    moved = placement.placement_key(((0, 3), (3, 4)), ("b", "a"), workers)
    assert moved != key and placement.next_epoch(key, 5, moved, 9) == 9  # a new split is a new placement


def test_fill_slots_honours_label_requirements() -> None:
    labels = {"a": (("node", "B"),), "b": (("node", "A"),), "c": (("node", "A"), ("zone", "1")), "d": ()}
    requires = ((("node", "A"),), (("node", "A"),), (("node", "B"),), ())
    # a (node B) waits for rank 2; d (no labels) only fits the unconstrained rank 3
    assert placement.fill_slots((None,) * 4, ["a", "b", "c", "d"], labels, requires) == ("b", "c", "a", "d")
    assert placement.fill_slots((None,) * 4, ["d", "a"], labels, requires) == (None, None, "a", "d")
    assert placement.fits((("node", "A"), ("zone", "1")), (("node", "A"),))
    assert not placement.fits((), (("node", "A"),))


@pytest.mark.parametrize(
    ("worker", "epoch", "expected"),
    [
        (None, 3, PENDING),  # vacant
        (view("a", READY, applied=3), 3, READY),
        (view("a", READY, applied=2), 3, PENDING),  # ready for an older placement: must rejoin
        (view("a", READY, applied=7), None, PENDING),  # no rendezvous yet
        (view("a", LOADING, applied=0), None, LOADING),
        (view("a", PENDING, applied=3), 3, PENDING),
        (view("a", READY, applied=3, timed_out=True), 3, UNHEALTHY),
        (view("a", UNHEALTHY, applied=3), 3, UNHEALTHY),
    ],
)
def test_shard_state(worker: WorkerView | None, epoch: int | None, expected: ShardState) -> None:
    assert placement.shard_state(worker, epoch) is expected


def _build(slots: placement.Slots, workers: dict[str, WorkerView], epoch: int | None, version: int = 7) -> Topology:
    return placement.build_topology(version=version, model=MODEL, pp=2, tp=2, limits=LIMITS, store_host="127.0.0.1",
                                    store_port=29500, slots=slots, workers=workers, epoch=epoch)  # fmt: skip


def test_build_topology_is_stage_major_with_split_layers() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abcd"}
    topo = _build(("a", "b", "c", "d"), workers, epoch=7)
    assert [(s.index, s.layer_start, s.layer_end) for s in topo.stages] == [(0, 0, 2), (1, 2, 4)]
    assert [(st.index, sh.tp_rank, sh.rank, sh.worker_id) for st, sh in topo.shards()] == [
        (0, 0, 0, "a"), (0, 1, 1, "b"), (1, 0, 2, "c"), (1, 1, 3, "d"),
    ]  # fmt: skip
    assert topo.rendezvous == Rendezvous("127.0.0.1", 29500, "topo/v7", 7, 4)
    assert topo.complete
    assert topo.find("c") == (topo.stages[1], topo.stages[1].shards[0])
    assert topo.find("zz") is None


def test_build_topology_partial_and_unhealthy() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abc"}
    partial = _build(("a", "b", "c", None), workers, epoch=None)
    assert partial.rendezvous is None and not partial.complete
    assert partial.stages[1].shards[1].vacant and partial.stages[1].shards[1].state is PENDING
    workers["d"] = view("d", READY, applied=7, timed_out=True)
    sick = _build(("a", "b", "c", "d"), workers, epoch=7)
    assert sick.rendezvous is not None and not sick.complete
    assert sick.stages[1].shards[1].state is UNHEALTHY


def test_topology_round_trips_through_protobuf() -> None:
    workers = {w: view(w, READY, applied=7) for w in "abcd"}
    for topo in (_build(("a", "b", "c", "d"), workers, epoch=7), _build(("a", None, "c", "d"), workers, None)):
        pb = topo.to_pb()
        assert Topology.from_pb(coordinator_pb2.Topology.FromString(pb.SerializeToString())) == topo
        assert pb.HasField("rendezvous") == (topo.rendezvous is not None)
    assert topo.to_pb().model.dtype == common_pb2.DTYPE_FLOAT32
    assert topo.to_pb().stages[1].shards[0].state == common_pb2.SHARD_STATE_PENDING


def test_shard_state_from_pb_rejects_unspecified() -> None:
    assert ShardState.from_pb(common_pb2.SHARD_STATE_READY) is READY
    with pytest.raises(ValueError, match="UNSPECIFIED"):
        ShardState.from_pb(common_pb2.SHARD_STATE_UNSPECIFIED)
    with pytest.raises(ValueError):
        ShardState.from_pb(99)


# -- TopologyStore --------------------------------------------------------------------------------------


def test_store_wakes_watchers_on_publish_and_close() -> None:
    first = _build((None,) * 4, {}, None, version=1)
    store = TopologyStore(first)
    assert store.wait_newer(0, timeout=0) == first
    assert store.wait_newer(1, timeout=0.01) is None
    assert store.wait_newer(42, timeout=0) == first  # from an earlier coordinator: start over
    got: list[Topology | None] = []
    waiter = threading.Thread(target=lambda: got.append(store.wait_newer(1, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    second = _build((None,) * 4, {}, None, version=2)
    store.publish(second)
    waiter.join(timeout=5)
    assert got == [second]
    with pytest.raises(ValueError, match="not newer"):
        store.publish(first)
    waiter = threading.Thread(target=lambda: got.append(store.wait_newer(2, timeout=5)))
    waiter.start()
    store.close()
    waiter.join(timeout=5)
    assert got[-1] is None and store.closed


# -- Registry with a fake clock ---------------------------------------------------------------------------


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
    with pytest.raises(UnknownWorker, match="worker_id"):
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


# -- command-line validation (in process: nothing listens) -------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path / "model"


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--tp", "3"], {}, "--tp: tensor parallel degree 3 must divide num_attention_heads=4"),
        (["--pp", "5"], {}, "--pp: cannot split 4 layers over 5 stages"),
        ([], {"SHARDMESH_COORDINATOR_PP": "5"}, "--pp: cannot split 4 layers over 5 stages"),
        (["--heartbeat-interval", "1", "--heartbeat-timeout", "0.5"], {}, "--heartbeat-timeout: must exceed"),
        (["--max-context", "4096"], {}, "--max-context: must be in 1..128"),
        (["--listen", "127.0.0.1"], {}, "--listen: expected host:port"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    model_dir: Path, flags: list[str], env: dict[str, str], message: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["coordinator", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["coordinator", "--model", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: --model:")


# -- the real process ----------------------------------------------------------------------------------


class CoordinatorProcess(ServiceProcess):
    """`shardmesh coordinator` in a child process, with its JSON log lines collected as they come."""

    def __init__(self, args: list[str]) -> None:
        super().__init__("coordinator", args)


class Watcher:
    """A WatchTopology stream read on a thread; checks that versions only ever increase."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> None:
        self.call = stub.WatchTopology(coordinator_pb2.WatchTopologyRequest())
        self.items: queue.Queue[Topology] = queue.Queue()
        self.latest: Topology | None = None
        self.ended = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(grpc.RpcError):
            for pb in self.call:
                self.items.put(Topology.from_pb(pb))
        self.ended.set()

    def wait_for(self, predicate: Callable[[Topology], bool], timeout: float = 10.0) -> Topology:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                topo = self.items.get(timeout=0.1)
            except queue.Empty:
                continue
            assert self.latest is None or topo.version > self.latest.version
            self.latest = topo
            if predicate(topo):
                return topo
        raise AssertionError(f"no matching topology within {timeout} s; latest: {self.latest}")


class Heartbeats:
    """Fake workers' heartbeat loops: READY, applying whatever version the coordinator last announced."""

    def __init__(self, stub: coordinator_pb2_grpc.CoordinatorStub, interval: float) -> None:
        self.stub, self.interval = stub, interval
        self.alive: dict[str, int] = {}  # worker id -> last topology version it heard of
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.errors: list[grpc.RpcError] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                alive = dict(self.alive)
            for worker_id, applied in alive.items():
                req = coordinator_pb2.HeartbeatRequest(worker_id=worker_id, state=common_pb2.SHARD_STATE_READY,
                                                       applied_topology_version=applied)  # fmt: skip
                try:
                    resp = self.stub.Heartbeat(req, timeout=5)
                except grpc.RpcError as e:
                    self.errors.append(e)
                    continue
                with self.lock:
                    if worker_id in self.alive:
                        self.alive[worker_id] = resp.topology_version

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@pytest.fixture
def coordinator(model_dir: Path) -> Iterator[CoordinatorProcess]:
    proc = CoordinatorProcess([
        "--listen", "127.0.0.1:0", "--model", str(model_dir), "--pp", "2", "--tp", "2",
        "--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.8", "--store-host", "127.0.0.1",
    ])  # fmt: skip
    try:
        yield proc
    finally:
        proc.kill()


def _wait_serving(channel: grpc.Channel, timeout: float = 10.0) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    for service in ("", SERVICE_NAME):
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"health of {service!r} not SERVING"
            time.sleep(0.05)


def _register(stub: coordinator_pb2_grpc.CoordinatorStub, worker_id: str, port: int):
    return stub.Register(coordinator_pb2.RegisterRequest(
        address=f"127.0.0.1:{port}", worker_id=worker_id, labels={"node_group": "test"},
        device=common_pb2.Device(type=common_pb2.DEVICE_TYPE_CPU, name="cpu", memory_bytes=1 << 30),
    ), timeout=5)  # fmt: skip


def _code(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_coordinator_process_end_to_end(coordinator: CoordinatorProcess) -> None:
    import torch.distributed as dist
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    port = coordinator.wait_event("listening", timeout=30)["port"]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    _wait_serving(channel)
    assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(channel).get_services()
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    watcher = Watcher(stub)
    first = watcher.wait_for(lambda t: True)
    assert first.rendezvous is None and all(sh.vacant for _, sh in first.shards())

    # Four workers fill the 2 × 2 slots stage-major; the full placement carries a rendezvous.
    ids = ["w0", "w1", "w2", "w3"]
    for i, worker_id in enumerate(ids):
        resp = _register(stub, worker_id, 61000 + i)
        assert resp.worker_id == worker_id
        assert resp.heartbeat_interval.ToTimedelta() == timedelta(seconds=0.2)
        assert resp.heartbeat_timeout.ToTimedelta() == timedelta(seconds=0.8)
    placed = watcher.wait_for(lambda t: t.rendezvous is not None)
    assert [(st.index, sh.tp_rank, sh.worker_id) for st, sh in placed.shards()] == [
        (0, 0, "w0"), (0, 1, "w1"), (1, 0, "w2"), (1, 1, "w3")
    ]  # fmt: skip
    rdv = placed.rendezvous
    assert rdv is not None and rdv.epoch == placed.version and rdv.prefix == f"topo/v{placed.version}"
    assert rdv.host == "127.0.0.1" and rdv.world_size == 4
    client = dist.TCPStore(rdv.host, rdv.port, None, False, timeout=timedelta(seconds=10))
    client.set(f"{rdv.prefix}/probe", "ok")  # the rendezvous store is real
    assert client.get(f"{rdv.prefix}/probe") == b"ok"

    # Heartbeats READY -> complete, in a new version with the same rendezvous.
    beats = Heartbeats(stub, interval=0.1)
    try:
        with beats.lock:
            beats.alive.update(dict.fromkeys(ids, 0))
        complete = watcher.wait_for(lambda t: t.complete)
        assert complete.rendezvous == rdv and complete.version > placed.version

        # Refusals map to status codes naming the field.
        assert _code(lambda: _register(stub, "bad id", 61009))[0] == grpc.StatusCode.INVALID_ARGUMENT
        code, details = _code(lambda: stub.Register(coordinator_pb2.RegisterRequest(address="nope"), timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("address:")
        code, details = _code(lambda: stub.Deregister(coordinator_pb2.DeregisterRequest(worker_id="ghost")))
        assert code == grpc.StatusCode.NOT_FOUND and "ghost" in details
        code, details = _code(lambda: stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id="w0")))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("state:")
        unknown = stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id="ghost",
                                                                  state=common_pb2.SHARD_STATE_READY))  # fmt: skip
        assert not unknown.known and unknown.topology_version >= complete.version

        # w3 goes silent: UNHEALTHY within the 0.8 s timeout (plus scheduling slack), same rendezvous.
        with beats.lock:
            del beats.alive["w3"]
        silent_at = time.monotonic()
        sick = watcher.wait_for(lambda t: t.stages[1].shards[1].state is UNHEALTHY, timeout=5)
        assert time.monotonic() - silent_at < 0.8 + 1.5
        assert not sick.complete and sick.rendezvous == rdv

        # w3 restarts and takes its slot back: a new rendezvous epoch, complete again once all rejoin.
        assert _register(stub, "w3", 61013).worker_id == "w3"
        with beats.lock:
            beats.alive["w3"] = 0
        back = watcher.wait_for(lambda t: t.complete, timeout=10)
        assert back.rendezvous is not None and back.rendezvous.epoch > rdv.epoch
        assert back.stages[1].shards[1].address == "127.0.0.1:61013"
        assert Topology.from_pb(stub.GetTopology(coordinator_pb2.GetTopologyRequest())).version >= back.version
    finally:
        beats.close()
    assert not beats.errors

    # SIGTERM: health goes NOT_SERVING, the watch stream ends, the process exits 0 within 5 s.
    health_watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert next(health_watch).status == health_pb2.HealthCheckResponse.SERVING
    signalled = time.monotonic()
    coordinator.proc.send_signal(signal.SIGTERM)
    assert next(health_watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    health_watch.cancel()  # an open health Watch would hold the server for its whole 2 s grace period
    assert coordinator.proc.wait(timeout=5) == 0
    assert time.monotonic() - signalled < 5
    assert watcher.ended.wait(timeout=5)
    events = [json.loads(line).get("event") for line in coordinator.lines if line.startswith("{")]
    assert "shutdown_started" in events and "worker_unhealthy" in events
    channel.close()
