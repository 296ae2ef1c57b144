"""Reporting failed workers to the coordinator: the `FailureReporter` against an in-process fake Coordinator
(what it sends and logs, deduplication, a coordinator that fails or is gone, stop), the scheduler's hook (a
failed step reports every worker of its mesh), and the gateway server wiring the two together.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from gateway.process import GatewayConfig, GatewayServer
from gateway.reporter import FailureReporter
from gateway.results import FinishReason
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from shardmesh.proto.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.unit.gateway.fakes import FakeMesh, FakeSource, LogLines, collect, finish, mesh_state, request
from tests.waiting import WAIT_S, wait_until


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """Records every ReportFailure; answers with the reported workers found in `lost`, or fails with `error`.
    Answers wait while `answer` is clear."""

    def __init__(self) -> None:
        self.address = ""
        self.requests: queue.Queue[coordinator_pb2.ReportFailureRequest] = queue.Queue()
        self.lost: set[str] = set()
        self.error: grpc.StatusCode | None = None
        self.answer = threading.Event()
        self.answer.set()

    def ReportFailure(self, request: Any, context: grpc.ServicerContext) -> coordinator_pb2.ReportFailureResponse:
        self.requests.put(request)
        self.answer.wait(WAIT_S)
        if self.error is not None:
            context.abort(self.error, "coordinator refuses")
        return coordinator_pb2.ReportFailureResponse(lost=[w for w in request.worker_ids if w in self.lost],
                                                     topology_version=7)  # fmt: skip

    def next_request(self) -> coordinator_pb2.ReportFailureRequest:
        return self.requests.get(timeout=WAIT_S)


class EventLog:
    """A logger double: each line's (event, fields) goes into a queue the test waits on."""

    def __init__(self) -> None:
        self.lines: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()

    def info(self, event: str, **fields: Any) -> None:
        self.lines.put((event, fields))

    warning = info

    def next(self) -> tuple[str, dict[str, Any]]:
        return self.lines.get(timeout=WAIT_S)


@pytest.fixture
def coordinator() -> Iterator[FakeCoordinator]:
    fake = FakeCoordinator()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield fake
    finally:
        fake.answer.set()
        server.stop(0).wait(WAIT_S)


@pytest.fixture
def log() -> EventLog:
    return EventLog()


@pytest.fixture
def now() -> list[float]:
    return [100.0]


@pytest.fixture
def reporter(coordinator: FakeCoordinator, log: EventLog, now: list[float]) -> Iterator[FailureReporter]:
    r = FailureReporter(coordinator.address, log, quiet=5.0, clock=lambda: now[0])
    r.start("gateway test")
    try:
        yield r
    finally:
        r.stop()


def test_a_report_goes_out_without_waiting_and_its_answer_is_logged(
    reporter: FailureReporter, coordinator: FakeCoordinator, log: EventLog
) -> None:
    coordinator.lost = {"w1"}
    coordinator.answer.clear()
    reporter.report(["w0", "w1"], "worker 127.0.0.1:7001 lost: UNAVAILABLE")  # returns while the answer is held
    request = coordinator.next_request()
    assert list(request.worker_ids) == ["w0", "w1"] and request.reporter == "gateway test"
    assert request.reason == "worker 127.0.0.1:7001 lost: UNAVAILABLE"
    assert log.lines.empty()
    coordinator.answer.set()
    assert log.next() == ("failure_reported", {
        "reason": "worker 127.0.0.1:7001 lost: UNAVAILABLE", "worker_ids": ["w0", "w1"], "lost": ["w1"],
        "topology_version": 7,
    })  # fmt: skip


def test_the_same_workers_are_reported_once_while_outstanding_and_shortly_after(
    reporter: FailureReporter, coordinator: FakeCoordinator, log: EventLog, now: list[float]
) -> None:
    coordinator.answer.clear()
    reporter.report(["w0", "w1"], "first")
    assert coordinator.next_request().reason == "first"
    reporter.report(["w1", "w0"], "outstanding")  # the same set, in another order: skipped
    reporter.report([], "nobody")  # nothing to report
    coordinator.answer.set()
    assert log.next()[1]["reason"] == "first"
    now[0] += 4.9  # within the quiet period after the answer: skipped
    reporter.report(["w0", "w1"], "too soon")
    reporter.report(["w1"], "another set")  # reports go out in order: what was skipped would come before this
    assert coordinator.next_request().reason == "another set"
    assert log.next()[1]["reason"] == "another set"
    now[0] += 0.2
    reporter.report(["w0", "w1", "w0"], "again")
    request = coordinator.next_request()
    assert (request.reason, list(request.worker_ids)) == ("again", ["w0", "w1"])
    assert log.next()[1]["reason"] == "again"


@pytest.mark.parametrize("gone", [False, True], ids=["refused", "gone"])
def test_a_failing_coordinator_is_logged_not_raised(coordinator: FakeCoordinator, log: EventLog, gone: bool) -> None:
    address = coordinator.address
    if gone:  # a port nobody listens on any more
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        server.stop(0).wait(WAIT_S)
    else:
        coordinator.error = grpc.StatusCode.UNAVAILABLE
    reporter = FailureReporter(address, log)
    reporter.start("gateway test")
    try:
        reporter.report(["w0"], "lost")
        event, fields = log.next()
        assert (event, fields["code"], fields["worker_ids"], fields["coordinator"]) == (
            "failure_report_failed", "UNAVAILABLE", ["w0"], address,
        )  # fmt: skip
        assert reporter.alive  # and it goes on: another set is reported
        reporter.report(["w1"], "lost")
        assert log.next()[0] == "failure_report_failed"
    finally:
        reporter.stop()


def test_stop_ends_an_outstanding_report_quietly(
    reporter: FailureReporter, coordinator: FakeCoordinator, log: EventLog
) -> None:
    coordinator.answer.clear()
    reporter.report(["w0"], "lost")
    coordinator.next_request()  # outstanding, answer held
    reporter.stop()
    assert not reporter.alive
    assert log.lines.empty()  # cancelled by stop: not a failure to report
    reporter.report(["w1"], "after stop")  # ignored, not raised
    reporter.stop()  # twice is harmless
    assert coordinator.requests.empty()
    FailureReporter(coordinator.address, log).stop()  # never started


# -- the scheduler's hook -------------------------------------------------------------------------------


def _reports() -> tuple[queue.Queue[tuple[list[str], str]], Any]:
    reports: queue.Queue[tuple[list[str], str]] = queue.Queue()
    return reports, lambda worker_ids, reason: reports.put((worker_ids, reason))


def test_a_failed_step_reports_every_worker_of_its_mesh(logger: Any, model_files: ModelFiles) -> None:
    reports, report_failure = _reports()
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logger, report_failure=report_failure)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=2, tp=2)
        scheduler.update_mesh(mesh_state(mesh, model_files))
        handle = scheduler.submit(request(model_files, "r", max_new=20))
        handle.events.get(timeout=WAIT_S)
        mesh.failures[(1, 1)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
        worker_ids, reason = reports.get(timeout=WAIT_S)
        assert worker_ids == ["w0", "w1", "w2", "w3"]  # not only the shard whose call failed
        assert reason == "worker 127.0.0.1:7011 (stage 1, tp rank 1) lost: UNAVAILABLE: Connection refused"
    finally:
        scheduler.shutdown(grace=0.0)


def test_a_step_failing_after_the_mesh_moved_is_not_reported(model_files: ModelFiles) -> None:
    logs = LogLines()
    reports, report_failure = _reports()
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logs.logger, report_failure=report_failure)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1)
        mesh.gate = threading.Event()
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
        handle = scheduler.submit(request(model_files, "r", max_new=3))
        assert mesh.entered.wait(WAIT_S)  # its first step is held on the old placement
        scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
        wait_until(lambda: any(e["event"] == "requests_resuming" for e in logs.events()))
        mesh.failures[(0, 0)] = (grpc.StatusCode.CANCELLED, "the old step")
        mesh.gate.set()
        assert finish(collect(handle)) is FinishReason.LENGTH  # replayed on the new placement, after the old step
        assert any(e["event"] == "step_failed" for e in logs.events())
        assert reports.empty()
    finally:
        scheduler.shutdown(grace=0.0)


def test_the_gateway_reports_a_failed_step_to_its_coordinator(
    coordinator: FakeCoordinator, model_files: ModelFiles
) -> None:
    logs = LogLines()
    mesh = FakeMesh(pp=1, tp=2)
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator=coordinator.address, step_timeout=5.0)
    server = GatewayServer(cfg, logs.logger, mesh_source=FakeSource(mesh_state(mesh, model_files)))
    server.start()
    try:
        # The step held until the failure is in place: waiting for the first token instead let a fast run finish
        # all 20 before the failure was set, and nothing was reported (a fresh-clone run failed so).
        mesh.gate = threading.Event()
        server.scheduler.submit(request(model_files, "r", max_new=20))
        assert mesh.entered.wait(WAIT_S)
        mesh.failures[(0, 1)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
        mesh.gate.set()
        sent = coordinator.next_request()
        assert (list(sent.worker_ids), sent.reporter) == (["w0", "w1"], f"gateway 127.0.0.1:{server.port}")
        assert "127.0.0.1:7001 (stage 0, tp rank 1) lost: UNAVAILABLE" in sent.reason
        wait_until(lambda: any(e["event"] == "failure_reported" for e in logs.events()))
    finally:
        server.stop(grace=0.0)
    assert not server.reporter.alive
