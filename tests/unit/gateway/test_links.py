"""The gateway's worker links: one channel per address, a health watch on each, closed cleanly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.links import WORKER_SERVICE, WorkerLinks
from tests.unit.gateway.fakes import LogLines

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class _CountWatches(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.opened = 0

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        if details.method == "/grpc.health.v1.Health/Watch":
            self.opened += 1
        return continuation(details)


class HealthOnly:
    """A worker stand-in that speaks only grpc.health.v1, as the real worker does (non-blocking Watch), and
    counts the Watch calls opened on it."""

    def __init__(self) -> None:
        self.health = health.HealthServicer(experimental_non_blocking=True,
                                            experimental_thread_pool=futures.ThreadPoolExecutor(2))  # fmt: skip
        self.watches = _CountWatches()
        self.server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[self.watches])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def set(self, status: int) -> None:
        self.health.set(WORKER_SERVICE, status)

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@pytest.fixture
def worker() -> Iterator[HealthOnly]:
    w = HealthOnly()
    try:
        yield w
    finally:
        w.stop()


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_workers_health_changes_are_followed_and_logged(worker: HealthOnly) -> None:
    logs = LogLines()
    lost: list[tuple[str, str]] = []
    links = WorkerLinks(logs.logger, 4 * 2**20, backoff=(0.05, 0.2), on_lost=lambda a, e: lost.append((a, e)))
    try:
        worker.set(NOT_SERVING)
        channel = links.channel(worker.address)
        assert links.channel(worker.address) is channel  # one channel per address, reused
        wait_for(lambda: links.health() == {worker.address: "NOT_SERVING"})
        worker.set(SERVING)
        wait_for(lambda: links.health()[worker.address] == "SERVING")
        worker.stop()
        wait_for(lambda: links.health()[worker.address] == "UNREACHABLE")
    finally:
        links.close()
    seen = [(e["address"], e["status"]) for e in logs.events() if e["event"] == "worker_health"]
    assert seen == [(worker.address, s) for s in ("NOT_SERVING", "SERVING", "UNREACHABLE")]
    unreachable = next(e for e in logs.events() if e.get("status") == "UNREACHABLE")
    assert unreachable["error"].startswith("UNAVAILABLE")
    assert [a for a, _ in lost] == [worker.address]  # once, when it went away (what the gateway reports)


def test_a_worker_never_reached_is_not_reported_lost() -> None:
    import socket

    with socket.socket() as s:  # bound, never listening
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        lost: list[str] = []
        links = WorkerLinks(LogLines().logger, 4 * 2**20, backoff=(0.05, 0.2), on_lost=lambda a, e: lost.append(a))
        try:
            links.channel(address)
            wait_for(lambda: links.health()[address] == "UNREACHABLE")
        finally:
            links.close()
        assert lost == []  # still starting, maybe: only a worker that answered and then vanished is reported


def test_close_ends_every_watch_and_refuses_new_channels(worker: HealthOnly) -> None:
    links = WorkerLinks(LogLines().logger, 4 * 2**20)
    worker.set(SERVING)
    links.channel(worker.address)
    links.channel("127.0.0.1:1")  # nothing listens there: its watch retries with backoff until closed
    wait_for(lambda: links.health()[worker.address] == "SERVING")
    t0 = time.monotonic()
    links.close()
    assert time.monotonic() - t0 < 3.0
    assert not [t for t in threading.enumerate() if t.name.startswith("health-watch")]
    with pytest.raises(RuntimeError, match="closed"):
        links.channel(worker.address)


def open_calls(channel: grpc.Channel) -> int:
    """Calls open on `channel` as gRPC Python counts them to run its polling thread: it starts the thread
    when a call begins with none open and the thread exits when the last one ends (grpcio is pinned; this
    reads its `_call_state.managed_calls`)."""
    return channel._call_state.managed_calls  # type: ignore[attr-defined]


def test_a_linked_channel_keeps_a_call_open_so_calls_start_no_polling_thread(worker: HealthOnly) -> None:
    """Why the watch is held open (see gateway/links.py): a `.future()` call on a channel with no call open
    starts a polling thread. Through the links, the health watch is open on the channel the whole time, so
    every step's call finds one open."""
    worker.set(SERVING)
    links = WorkerLinks(LogLines().logger, 4 * 2**20)
    try:
        linked = links.channel(worker.address)
        wait_for(lambda: links.health()[worker.address] == "SERVING")  # the watch has answered: it is open
        with grpc.insecure_channel(worker.address) as bare:
            assert open_calls(bare) == 0  # without the links, the next call would find none open
        stub = health_pb2_grpc.HealthStub(linked)
        for _ in range(10):
            assert open_calls(linked) >= 1
            stub.Check.future(health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=5).result()
        assert open_calls(linked) >= 1
        assert worker.watches.opened == 1  # one watch all along, never ended and re-opened
    finally:
        links.close()
