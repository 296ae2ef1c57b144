"""`serve_until_signal`: a service starts, serves until SIGTERM or SIGINT, and is stopped whatever happened;
the signal handlers it installs are gone afterwards.

The signals are real: the fake service sends one to this process, and the handler runs on the main
thread, where pytest runs the test.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from shardmesh.rpc.lifecycle import serve_until_signal
from tests.waiting import WAIT_S


class Events:
    """A logger that records (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict]] = []

    def info(self, event: str, **fields: object) -> None:
        self.lines.append(("info", event, fields))

    def error(self, event: str, **fields: object) -> None:
        self.lines.append(("error", event, fields))

    def events(self) -> list[str]:
        return [event for _, event, _ in self.lines]


class FakeService:
    """Records start and stop; `start` may send a signal, fail, or wait until `stop` (a worker registering)."""

    def __init__(self, signum: int | None = signal.SIGTERM, fail: Exception | None = None,
                 wait_for_stop: bool = False) -> None:  # fmt: skip
        self.signum, self.fail, self.wait_for_stop = signum, fail, wait_for_stop
        self.calls: list[str] = []
        self.stopping = threading.Event()
        self.start_ended = threading.Event()

    def start(self) -> None:
        self.calls.append("start")
        try:
            if self.signum is not None:
                os.kill(os.getpid(), self.signum)
            if self.fail is not None:
                raise self.fail
            if self.wait_for_stop:
                assert self.stopping.wait(WAIT_S)
                self.calls.append("start saw stop")
        finally:
            self.start_ended.set()

    def stop(self) -> None:
        self.calls.append("stop")
        self.stopping.set()


@pytest.fixture(autouse=True)
def handlers_restored() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_service_after_it_started(signum: int) -> None:
    service, log = FakeService(signum), Events()
    assert serve_until_signal(service, log) is True
    assert service.calls == ["start", "stop"]
    assert log.events() == ["signal_received"]


def test_a_failed_start_in_the_foreground_is_raised_after_stop() -> None:
    service, log = FakeService(signum=None, fail=RuntimeError("--listen: cannot listen on 1.2.3.4:5")), Events()
    with pytest.raises(RuntimeError, match="--listen"):
        serve_until_signal(service, log)
    assert service.calls == ["start", "stop"]
    assert log.events() == []


def test_a_failed_start_in_the_background_is_logged_and_ends_serving() -> None:
    service, log = FakeService(signum=None, fail=RuntimeError("coordinator refused registration")), Events()
    assert serve_until_signal(service, log, start_in_background=True) is False
    assert service.calls == ["start", "stop"]
    assert log.lines == [("error", "start_failed", {"error": "coordinator refused registration"})]


def test_a_signal_while_starting_in_the_background_stops_the_service_at_once() -> None:
    """The start is still waiting (for a coordinator, say) when the signal comes: `stop` must not wait for it."""
    service, log = FakeService(wait_for_stop=True), Events()
    assert serve_until_signal(service, log, start_in_background=True) is True
    assert service.start_ended.wait(WAIT_S)
    assert service.calls == ["start", "stop", "start saw stop"]
    assert log.events() == ["signal_received"]
