"""The real `shardmesh coordinator` process driven by fake workers over gRPC: placement, rendezvous, heartbeats,
a silent worker, a restart, refusals by status code, and a graceful SIGTERM."""

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

from coordinator.servicer import SERVICE_NAME
from shardmesh.core.topology import ShardState, Topology
from shardmesh.proto.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from tests.stack import ServiceProcess

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 128,
}  # fmt: skip
UNHEALTHY = ShardState.UNHEALTHY


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path / "model"


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

        # w3 goes silent: UNHEALTHY, lost to the 0.8 s heartbeat timeout (registry.expire, whose arithmetic the unit
        # tests check on a fake clock), same rendezvous.
        with beats.lock:
            del beats.alive["w3"]
        sick = watcher.wait_for(lambda t: t.stages[1].shards[1].state is UNHEALTHY, timeout=30)
        assert not sick.complete and sick.rendezvous == rdv
        lost = coordinator.wait_event("worker_lost")
        assert lost["worker_id"] == "w3" and lost["reason"] == "heartbeat_timeout", lost

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
    assert "shutdown_started" in events and "worker_lost" in events
    channel.close()
