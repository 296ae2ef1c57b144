"""The Coordinator servicer's failure reports, drains and watch streams, called directly on a real registry
(the probe of a reported worker is injected: a real one is a grpc.health.v1 check of its address)."""

from __future__ import annotations

import threading

import pytest

from coordinator.registry import Device, Registration, Registry
from coordinator.servicer import CoordinatorServicer, unreachable
from shardmesh.core.errors import InvalidArgument, NotFound
from shardmesh.core.topology import HeldShard, ModelSpec, ServingLimits, Topology, WorkerState
from shardmesh.proto.v1 import coordinator_pb2

MODEL = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)


class Context:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active

    def invocation_metadata(self) -> tuple:
        return ()


def _registry(**kw: object) -> Registry:
    reg = Registry(model=MODEL, pp=2, tp=1, limits=ServingLimits(4, 128, 128), store_host="127.0.0.1",
                   store_port=29500, heartbeat_timeout=3.0, **kw)  # type: ignore[arg-type]  # fmt: skip
    return reg


def _register(reg: Registry, i: int, held: HeldShard | None = None, last: int = 0) -> str:
    return reg.register(Registration(f"127.0.0.1:{7000 + i}", Device("cpu", "cpu", 1 << 30), (), f"w{i}", 0,
                                     last, held))[0]  # fmt: skip


def test_report_failure_loses_only_the_workers_that_do_not_answer() -> None:
    reg = _registry()
    for i in range(3):
        _register(reg, i)
    probed: list[str] = []

    def probe(address: str) -> str:
        probed.append(address)
        return "health check UNAVAILABLE" if address.endswith(":7001") else ""

    servicer = CoordinatorServicer(reg, 1.0, probe=probe)
    request = coordinator_pb2.ReportFailureRequest(worker_ids=["w0", "w1", "w1", "nobody"], reason="step 7 failed",
                                                   reporter="gateway 127.0.0.1:1")  # fmt: skip
    response = servicer.ReportFailure(request, Context())
    assert list(response.lost) == ["w1"] and sorted(probed) == ["127.0.0.1:7000", "127.0.0.1:7001"]
    t = reg.store.current()
    assert response.topology_version == t.version and t.find("w2")[1].rank == 1  # type: ignore[index]  # the spare
    lost = t.worker("w1")
    assert lost is not None and lost.state is WorkerState.LOST and "step 7 failed" in lost.detail
    with pytest.raises(InvalidArgument, match=r"^worker_ids"):
        servicer.ReportFailure(coordinator_pb2.ReportFailureRequest(), Context())
    with pytest.raises(InvalidArgument, match=r"^worker_ids\[0\]"):
        servicer.ReportFailure(coordinator_pb2.ReportFailureRequest(worker_ids=["bad id"]), Context())


def test_drain_answers_state_and_what_it_waits_for() -> None:
    reg = _registry()
    for i in range(2):
        _register(reg, i)
    servicer = CoordinatorServicer(reg, 1.0)
    response = servicer.Drain(coordinator_pb2.DrainRequest(worker_id="w1"), Context())
    assert response.state == WorkerState.DRAINING.to_pb() and "waiting for a spare" in response.message
    with pytest.raises(NotFound):
        servicer.Drain(coordinator_pb2.DrainRequest(worker_id="w9"), Context())


def test_a_recovering_coordinator_tells_watchers_nothing_until_it_has_its_placement() -> None:
    reg = _registry(recovery_grace=60.0)
    servicer = CoordinatorServicer(reg, 1.0)
    received: list[Topology] = []
    first = threading.Event()
    context = Context()

    def watch() -> None:
        for pb in servicer.WatchTopology(coordinator_pb2.WatchTopologyRequest(), context):
            received.append(Topology.from_pb(pb))
            first.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    _register(reg, 0, HeldShard(5, 0, 2, 1, 0, 2, served=True), last=9)
    assert not first.wait(0.3) and not received  # half the placement: nothing said
    _register(reg, 1, HeldShard(5, 1, 2, 1, 2, 4, served=True), last=9)
    assert first.wait(10.0)
    context.active = False
    reg.store.close()
    thread.join(5.0)
    assert received[0].epoch == 5 and received[0].version > 9 and received[0].calibration.passed


def test_unreachable_names_a_closed_port() -> None:
    import socket

    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        assert unreachable(address, timeout=2.0).startswith("health check")
