"""`shardmesh drain` against a fake coordinator: the drain is asked for, each change of the worker is printed,
and the exit code says whether it left the mesh (0) or not (1: refused, unreachable, lost, timed out)."""

from __future__ import annotations

import socket

import grpc
import pytest

from shardmesh.core.topology import Topology, WorkerState
from shardmesh_cli import drain
from shardmesh_cli.main import main
from tests.unit.cli.fake_coordinator import Script, serve, topology, worker

WAITING = "waiting for a spare to take stage 0 tp rank 1"


@pytest.fixture(autouse=True)
def _no_poll_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drain, "POLL_S", 0.0)  # the fake coordinator moves on per call, not per second


def _with(*states: tuple[WorkerState, str]) -> list[Topology]:
    """Topologies in which worker-1 (rank 1) is in each of `states` in turn, then one without it."""
    spare = worker(4, WorkerState.SPARE)
    return [*(topology(worker(0, WorkerState.SERVING, 0), worker(1, s, 1, d), spare) for s, d in states),
            topology(worker(0, WorkerState.SERVING, 0), worker(4, WorkerState.LOADING, 1))]  # fmt: skip


def test_drain_waits_until_the_worker_has_left_the_topology(capsys: pytest.CaptureFixture[str]) -> None:
    script = Script(_with((WorkerState.DRAINING, WAITING), (WorkerState.DRAINING, WAITING),
                          (WorkerState.DRAINING, "worker-4 takes the slot; replaying 3 sequences")))  # fmt: skip
    with serve(script) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-1"]) == 0
    assert script.drained == ["worker-1"] and script.gets == 4
    assert capsys.readouterr().err.splitlines() == [
        "worker-1: draining: waiting for a spare (topology v8)",  # Drain's answer
        f"worker-1: draining: {WAITING}",  # then each change, once
        "worker-1: draining: worker-4 takes the slot; replaying 3 sequences",
        "worker-1 drained",
    ]


def test_drain_keeps_watching_while_the_coordinator_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    script = Script(_with((WorkerState.DRAINING, WAITING)), unavailable=2)
    with serve(script) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-1"]) == 0
    assert capsys.readouterr().err.splitlines()[1:] == [
        "worker-1: coordinator unreachable: UNAVAILABLE: restarting",
        f"worker-1: draining: {WAITING}",
        "worker-1 drained",
    ]


def test_no_wait_only_asks(capsys: pytest.CaptureFixture[str]) -> None:
    script = Script(_with((WorkerState.DRAINING, WAITING)))
    with serve(script) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-1", "--no-wait"]) == 0
    assert script.drained == ["worker-1"] and script.gets == 0
    assert capsys.readouterr().err == "worker-1: draining: waiting for a spare (topology v8)\n"


def test_timeout_says_what_the_drain_still_waits_for(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(Script(_with((WorkerState.DRAINING, WAITING)))) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-1", "--timeout", "0"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"error: worker-1 not drained after 0 s; still draining: {WAITING}"


def test_a_worker_lost_while_draining_fails_the_drain(capsys: pytest.CaptureFixture[str]) -> None:
    with serve(Script(_with((WorkerState.LOST, "no heartbeat for 10 s")))) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-1"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: worker-1 was lost before its drain finished: no heartbeat for 10 s"
    )


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT])
def test_a_refused_drain_is_one_error_line(capsys: pytest.CaptureFixture[str], code: grpc.StatusCode) -> None:
    script = Script(_with(), drain=(code, "worker_id: no worker 'worker-9'"))
    with serve(script) as coordinator:
        assert main(["drain", "--coordinator", coordinator, "worker-9"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: coordinator {coordinator}: drain worker-9: {code.name}: worker_id: no worker 'worker-9'\n"
    assert script.gets == 0


def test_an_unreachable_coordinator_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert main(["drain", "--coordinator", address, "worker-1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: coordinator {address}: drain worker-1: UNAVAILABLE: ") and err.count("\n") == 1
    assert "Traceback" not in err


def test_a_negative_timeout_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drain", "--coordinator", "127.0.0.1:1", "worker-1", "--timeout", "-1"]) == 2
    assert "error: --timeout: must be >= 0 seconds, got -1.0" in capsys.readouterr().err
