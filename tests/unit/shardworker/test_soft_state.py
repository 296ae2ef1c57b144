"""What a worker keeps across a coordinator restart, on real stage cores over real Gloo links in this process:
`held()` describes the shard and groups it holds (with `served` once a request's step ran in the epoch, not for
calibration), a second registration (a heartbeat answered known=false) claims them with the pid and the newest
version seen, and a new epoch forms its groups on the store a restarted coordinator serves on the same port while
the old groups keep stepping without one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardmesh.core.step import SamplingParams, StepEntry
from shardmesh.core.topology import HeldShard, ShardState
from shardworker.process import WorkerProcess
from shardworker.runtime import StageWorkerCore, StepResult
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.unit.shardworker.cores import apply_all, new_core, new_store, run_step
from tests.unit.shardworker.fakes import Events, FakeCoordinator, mesh
from tests.waiting import wait_until

PROMPT = (1, 17, 5, 42)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("soft"), "llama-gqa-tied", num_layers=4, seed=3)


def step_all(cores: list[StageWorkerCore], version: int, request_id: str = "r") -> list[StepResult]:
    """One prefill step of PROMPT through every stage at once; the results in stage order."""
    results = run_step(cores, version, [StepEntry(request_id, 0, 0, len(PROMPT), PROMPT, SamplingParams())])
    for core in cores:
        core.release([(request_id, 0)])
    return results


def test_a_core_without_a_runtime_holds_nothing(model: Path, store: dist.TCPStore) -> None:
    core = new_core("w0")
    assert core.held() is None
    core.apply(mesh(model, 1, ("w1",), epoch=1, store_port=store.port))  # a slot, but somebody else's
    assert core.held() is None and core.state is ShardState.PENDING


def test_held_names_the_epoch_rank_and_layers_and_served_flips_with_the_first_step(
    model: Path, store: dist.TCPStore
) -> None:
    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, mesh(model, 5, ("w0", "w1"), epoch=5, store_port=store.port))
    assert [core.held() for core in cores] == [HeldShard(5, 0, 2, 1, 0, 2, served=False),
                                               HeldShard(5, 1, 2, 1, 2, 4, served=False)]  # fmt: skip
    last = step_all(cores, 5)[-1]
    assert last.sampled[0].token_id == reference_greedy(model, list(PROMPT), 1)[0][0]
    assert [core.held() for core in cores] == [HeldShard(5, 0, 2, 1, 0, 2, served=True),
                                               HeldShard(5, 1, 2, 1, 2, 4, served=True)]  # fmt: skip
    apply_all(cores, mesh(model, 6, ("w0", "w1"), epoch=6, store_port=store.port))  # a new epoch: not served yet
    assert [core.held() for core in cores] == [HeldShard(6, 0, 2, 1, 0, 2, served=False),
                                               HeldShard(6, 1, 2, 1, 2, 4, served=False)]  # fmt: skip


def test_calibration_is_not_serving(model: Path, store: dist.TCPStore) -> None:
    core = new_core("w0")
    apply_all([core], mesh(model, 2, ("w0",), epoch=2, store_port=store.port))
    core.calibrate(2, decode_batch=1, prefill_tokens=4, iterations=1)
    held = core.held()
    assert held is not None and not held.served
    step_all([core], 2)
    assert core.held() == HeldShard(2, 0, 1, 1, 0, 4, served=True)


def test_a_new_epoch_forms_its_groups_on_the_store_of_a_restarted_coordinator(model: Path) -> None:
    old = new_store()
    port = old.port
    cores = [new_core("w0"), new_core("w1")]
    apply_all(cores, mesh(model, 1, ("w0", "w1"), epoch=1, store_port=port))
    del old  # the coordinator died, and its store with it
    step_all(cores, 1)  # formed groups need no store
    restarted = new_store(port)  # the new coordinator serves a new store, on the same port
    assert restarted.port == port
    apply_all(cores, mesh(model, 2, ("w0", "w1"), epoch=2, store_port=port))
    assert step_all(cores, 2)[-1].sampled[0].token_id == reference_greedy(model, list(PROMPT), 1)[0][0]


@pytest.fixture
def coordinator(model: Path, store: dist.TCPStore) -> Iterator[FakeCoordinator]:
    c = FakeCoordinator(mesh(model, 3, ("w0",), epoch=3, store_port=store.port))
    try:
        yield c
    finally:
        c.close()


def test_registering_again_claims_the_held_shard_with_the_pid_and_newest_version(
    model: Path, store: dist.TCPStore, coordinator: FakeCoordinator
) -> None:
    proc = WorkerProcess(coordinator.worker_config("w0"), Events())
    try:
        proc.start()
        first = coordinator.registrations[0]
        assert (first.worker_id, first.pid, first.last_topology_version) == ("w0", os.getpid(), 0)
        assert not first.HasField("held")  # nothing held yet
        core = proc.core
        assert core is not None
        wait_until(lambda: core.state is ShardState.READY)
        step_all([core], 3)
        coordinator.forget()  # as a restarted coordinator would: the next heartbeat answers known=false
        wait_until(lambda: len(coordinator.registrations) == 2)
        again = coordinator.registrations[1]
        assert (again.worker_id, again.pid, again.last_topology_version) == ("w0", os.getpid(), 3)
        assert again.HasField("held")
        assert HeldShard.from_pb(again.held) == HeldShard(3, 0, 1, 1, 0, 4, served=True)
    finally:
        proc.stop()
    assert coordinator.deregistered == ["w0"]


def test_a_spare_asked_to_prepare_a_slot_loads_it_ahead_and_takes_it_over_without_loading_again(
    model: Path, store: dist.TCPStore
) -> None:
    from shardmesh.core.topology import MeshWorker, WorkerState

    events = Events()
    spare = StageWorkerCore("w2", torch.device("cpu"), events, 30.0)
    asked = MeshWorker("w2", "127.0.0.1:1", 0, WorkerState.SPARE, preparing_rank=1)
    spare.prepare(mesh(model, 3, ("w0", "w1"), epoch=3, store_port=store.port, workers=(asked,)))
    assert spare.prepared_rank == 1 and spare.state is ShardState.PENDING  # loaded, in no group: still a spare
    assert events.events().count("shard_loaded") == 1
    survivor = new_core("w0")
    apply_all([survivor, spare], mesh(model, 4, ("w0", "w2"), epoch=4, store_port=store.port))  # the hand-over
    assert events.events().count("shard_loaded") == 1  # the prepared weights, not a second load
    assert spare.prepared_rank is None and spare.held() == HeldShard(4, 1, 2, 1, 2, 4)
    last = step_all([survivor, spare], 4)[-1]
    assert last.sampled[0].token_id == reference_greedy(model, list(PROMPT), 1)[0][0]
