"""A drained worker leaves on its own: `should_exit` on hand-built topologies, then the whole path, in this
process (serve_until_signal returns True after `drained`, Deregister, no signal) and as `shardmesh worker`,
which exits 0. A draining worker that still holds its slot keeps serving, in a new epoch too.
"""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from shardmesh.core.topology import ShardState, WorkerState
from shardmesh.rpc import procs
from shardmesh.rpc.lifecycle import serve_until_signal
from shardworker.process import WorkerProcess, should_exit
from tests.checkpoints import make_checkpoint
from tests.unit.shardworker.fakes import Events, FakeCoordinator, mesh, worker
from tests.waiting import WAIT_S, wait_until

DRAINING, SERVING, SPARE = WorkerState.DRAINING, WorkerState.SERVING, WorkerState.SPARE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("drain"), "llama-gqa-tied", num_layers=2, seed=5)


# ---- the decision ----------------------------------------------------------------------------------------


def test_a_draining_worker_whose_slot_moved_exits(model: Path) -> None:
    t = mesh(model, 7, ("w1",), workers=(worker("w0", DRAINING), worker("w1", SERVING, 0)))
    assert should_exit(t, "w0")


def test_a_draining_worker_that_still_holds_its_slot_keeps_serving(model: Path) -> None:
    t = mesh(model, 7, ("w0", "w1"), workers=(worker("w0", DRAINING, 0), worker("w1", SERVING, 1)))
    assert not should_exit(t, "w0")


@pytest.mark.parametrize("state", [SPARE, SERVING, WorkerState.LOADING, WorkerState.LOST])
def test_a_worker_that_is_not_draining_stays(model: Path, state: WorkerState) -> None:
    t = mesh(model, 7, ("w1",), workers=(worker("w0", state), worker("w1", SERVING, 0)))
    assert not should_exit(t, "w0")


def test_a_worker_the_topology_does_not_list_stays(model: Path) -> None:
    """A coordinator that lists no workers (or not this one yet) tells it nothing."""
    assert not should_exit(mesh(model, 7, ("w1",)), "w0")
    assert not should_exit(mesh(model, 7, ("w1",), workers=(worker("w1", DRAINING),)), "w0")


# ---- the process -----------------------------------------------------------------------------------------


@pytest.fixture
def coordinator(model: Path, store: dist.TCPStore) -> Iterator[FakeCoordinator]:
    c = FakeCoordinator(mesh(model, 1, ("w0",), epoch=1, store_port=store.port,
                             workers=(worker("w0", SERVING, 0), worker("w1", SPARE))))  # fmt: skip
    try:
        yield c
    finally:
        c.close()


def in_background(scenario: Callable[[], None], give_up: threading.Event) -> list[BaseException]:
    """Run `scenario` on its own thread, as the coordinator's side; `give_up` is set if it fails, so that a
    test serving on the main thread never waits for a drain that will not come. Its error, if any, in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scenario()
        except BaseException as e:  # asserted on by the test
            errors.append(e)
            give_up.set()

    threading.Thread(target=run, name="scenario", daemon=True).start()
    return errors


def test_a_drained_worker_deregisters_and_ends_serving_without_a_signal(
    model: Path, store: dist.TCPStore, coordinator: FakeCoordinator
) -> None:
    logger = Events()
    proc = WorkerProcess(coordinator.worker_config("w0"), logger)

    def scenario() -> None:
        wait_until(lambda: proc.core is not None and proc.core.state is ShardState.READY)
        core = proc.core
        # Drained while it still holds its slot, in a new epoch even: it keeps serving (and joins it).
        coordinator.publish(mesh(model, 2, ("w0",), epoch=2, store_port=store.port,
                                 workers=(worker("w0", DRAINING, 0), worker("w1", SPARE))))  # fmt: skip
        wait_until(lambda: (held := core.held()) is not None and held.epoch == 2)
        assert not proc.exit_requested.is_set()
        # A spare took the slot: now it leaves.
        coordinator.publish(mesh(model, 3, ("w1",), epoch=3, store_port=store.port,
                                 workers=(worker("w0", DRAINING), worker("w1", SERVING, 0))))  # fmt: skip
        assert proc.exit_requested.wait(WAIT_S)

    errors = in_background(scenario, proc.exit_requested)
    assert serve_until_signal(proc, logger, start_in_background=True, stop=proc.exit_requested) is True
    assert not errors, errors
    assert ("info", "drained", {"worker_id": "w0", "version": 3}) in logger.lines
    assert "signal_received" not in logger.events()
    assert logger.events()[-1] == "shutdown_complete"
    assert coordinator.deregistered == ["w0"]


def test_shardmesh_worker_exits_0_once_drained(model: Path, tmp_path: Path) -> None:
    coordinator = FakeCoordinator(mesh(model, 1, ("w1",), workers=(worker("w0", SPARE), worker("w1", SERVING, 0))))
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "SHARDMESH_LOG_LEVEL": "info", "OMP_NUM_THREADS": "1"}
    with log_path.open("wb") as log:
        p = procs.spawn(["-m", "shardmesh_cli", "worker", "--coordinator", coordinator.address, "--worker-id", "w0"],
                        env=env, stdout=log, stderr=log)  # fmt: skip
    try:
        wait_until(lambda: len(coordinator.registrations) == 1 or p.poll() is not None, timeout=WAIT_S * 6)
        assert coordinator.registrations, log_path.read_text()
        assert coordinator.registrations[0].pid == p.pid
        coordinator.publish(mesh(model, 2, ("w1",), workers=(worker("w0", DRAINING), worker("w1", SERVING, 0))))
        assert p.wait(timeout=WAIT_S * 3) == 0, log_path.read_text()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the drained worker did not exit:\n{log_path.read_text()}") from None
    finally:
        procs.stop_all([p])
        coordinator.close()
    lines = log_path.read_text()
    assert '"event": "drained"' in lines and '"event": "shutdown_complete"' in lines, lines
    assert "signal_received" not in lines
    assert coordinator.deregistered == ["w0"]
