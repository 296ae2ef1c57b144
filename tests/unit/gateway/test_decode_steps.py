"""Several decode steps per call (`SchedulerConfig.decode_steps`, worker.proto `StepRequest.decode_steps`) against a
fake mesh whose shards feed each entry its drawn token like real workers: only a mesh with one step in flight gets
them (a single stage, or stages taking turns; not a full pipeline), only for sequences decoding, never past a
request's last token; a stop condition inside a call drops the call's later tokens; a paged mesh's tables cover
every position the call writes; a failed call loses no token."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gateway.results import FinishReason, TokenEvent
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from tests.unit.gateway.fakes import (
    FakeMesh,
    collect,
    eos_of,
    finish,
    ids_of,
    mesh_state,
    request,
    started,
    tokens,
)
from tests.waiting import WAIT_S, wait_until


@pytest.fixture
def scheduler(logger: Any) -> Iterator[Scheduler]:
    with started(SchedulerConfig(max_queue=8, step_timeout=5.0, decode_steps=4), logger) as s:
        yield s


def calls(mesh: FakeMesh, request_id: str) -> list[tuple[int, int]]:
    """(start_pos, decode_steps) of each call carrying the request, on the first shard."""
    return [(e.start_pos, step.decode_steps) for step in mesh.shards[0].steps for e in step.entries
            if e.request_id == request_id]  # fmt: skip


def test_a_single_stage_mesh_decodes_several_steps_per_call(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=2)
    mesh.script["r"] = list(range(40, 50))
    scheduler.update_mesh(mesh_state(mesh, model_files))
    events = collect(scheduler.submit(request(model_files, "r", "hi", max_new=10)))
    assert tokens(events) == list(range(40, 50)) and finish(events) is FinishReason.LENGTH
    assert [e.index for e in events if isinstance(e, TokenEvent)] == list(range(10))
    # The prompt (2 tokens), then calls of 4, 4 and the one token left (0 on the wire: one step).
    assert calls(mesh, "r") == [(0, 0), (2, 4), (6, 4), (10, 0)]
    stub = scheduler.snapshot()[0].view.shards[0].stub  # type: ignore[union-attr]
    assert stub.Step.timeouts == [5.0, 20.0, 20.0, 5.0]  # the step timeout for each step of the call
    assert [s.steps for s in mesh.shards] == [mesh.shards[0].steps] * 2  # every tp rank got the same calls
    for shard in mesh.shards:
        wait_until(lambda shard=shard: shard.released_ids() == ["r"])


def test_the_shortest_budget_in_the_batch_bounds_the_call(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    handles = [scheduler.submit(request(model_files, rid, "hi", max_new=n)) for rid, n in (("a", 9), ("b", 3))]
    mesh.gate.set()
    assert [len(tokens(collect(h))) for h in handles] == [9, 3]
    steps = [s.decode_steps for s in mesh.shards[0].steps if len(s.entries) == 2 and s.entries[0].num_tokens == 1]
    assert steps and max(steps) == 2  # b had 2 tokens left after its prompt: no call ran past them


def test_a_stop_inside_a_call_drops_the_rest_of_its_tokens(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    eos = eos_of(model_files)
    mesh.script["r"] = [*ids_of(model_files, "ab"), eos, *ids_of(model_files, "cdefgh")]
    scheduler.update_mesh(mesh_state(mesh, model_files))
    events = collect(scheduler.submit(request(model_files, "r", "hi", max_new=20)))
    assert tokens(events) == [*ids_of(model_files, "ab"), eos] and finish(events) is FinishReason.EOS
    assert calls(mesh, "r") == [(0, 0), (2, 4)]  # the call drew b, eos, c, d: c and d are dropped
    wait_until(lambda: mesh.shards[0].released_ids() == ["r"])
    mesh.script["s"] = ids_of(model_files, "abcdefgh")
    stop = collect(scheduler.submit(request(model_files, "s", "hi", max_new=20, stop=("c",))))
    assert tokens(stop) == ids_of(model_files, "abc") and finish(stop) is FinishReason.STOP_STRING


def test_stages_taking_turns_decode_several_steps_per_call(logger: Any, model_files: ModelFiles) -> None:
    with started(SchedulerConfig(max_queue=8, step_timeout=5.0, decode_steps=4, pipeline_depth=1), logger) as s:
        mesh = FakeMesh(pp=2, tp=1)
        mesh.script["r"] = list(range(40, 50))
        s.update_mesh(mesh_state(mesh, model_files))
        assert tokens(collect(s.submit(request(model_files, "r", "hi", max_new=10)))) == list(range(40, 50))
        assert calls(mesh, "r") == [(0, 0), (2, 4), (6, 4), (10, 0)]
        assert [s.steps for s in mesh.shards] == [mesh.shards[0].steps] * 2  # both stages got the same calls


def test_a_full_pipeline_runs_one_step_per_call(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=2, tp=1)  # the scheduler's depth: one step in flight per stage
    scheduler.update_mesh(mesh_state(mesh, model_files))
    assert len(tokens(collect(scheduler.submit(request(model_files, "r", "hi", max_new=8))))) == 8
    assert {steps for _, steps in calls(mesh, "r")} == {0}


def test_a_paged_call_covers_every_position_it_writes(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1, kv_block_size=4, kv_blocks=16)
    mesh.script["r"] = list(range(60, 71))
    scheduler.update_mesh(mesh_state(mesh, model_files))
    assert tokens(collect(scheduler.submit(request(model_files, "r", "hello", max_new=11)))) == list(range(60, 71))
    last = mesh.shards[0].steps[-1].entries[0]
    # The shard checked every call's table and recorded each position's token: the log but its last token.
    log = [*ids_of(model_files, "hello"), *range(60, 70)]
    assert mesh.shards[0].tokens_in(list(last.blocks), len(log)) == log
    assert [steps for _, steps in calls(mesh, "r")] == [0, 4, 4, 2]  # 1 + 4 + 4 + 2 tokens


def test_a_failed_call_loses_no_token(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=2, kv_slots=1)
    mesh.default_script = list(range(30, 50))
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.step_delay = 0.01
    running = scheduler.submit(request(model_files, "r", max_new=20))
    sent = [running.events.get(timeout=WAIT_S) for _ in range(3)]
    mesh.failures[(0, 1)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
    wait_until(lambda: not scheduler.snapshot()[1])
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    events = sent + collect(running)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == list(range(30, 50))  # none lost or twice
    assert finish(events) is FinishReason.LENGTH
    failed = [s for s in mesh.shards[0].steps if s.topology_version == 1][-1]
    assert failed.decode_steps > 1  # the call that failed was one of several steps
