"""The gateway's half of a pipeline: with pp stages it keeps up to pp steps (micro-batches) in flight,
chained by `after_step_id`, over fake shards that keep that order like workers.

- `StepCall`: after a failure the other shards settle, then are cancelled; a silent one hits the backstop.
- The scheduler: two micro-batches in flight at pp=2 (one at pp=1), the chain, and a failure that fails
  both micro-batches but releases a slot only once no step in flight uses it.

The worker's half is in tests/unit/shardworker/test_pipeline.py, the whole path over real processes in
tests/e2e/test_pipeline.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import grpc
import pytest
import structlog

from gateway.fanout import ShardClient, ShardFailure, StepCall
from gateway.results import FinishReason, TokenEvent
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from shardmesh.proto.v1 import worker_pb2
from shardworker.ordering import StepOrder
from tests.unit.gateway.fakes import FakeMesh, FakeRpcError, FakeShard, collect, finish, mesh_state, request, tokens
from tests.waiting import WAIT_S, wait_until


def _shards(n: int) -> list[ShardClient]:
    return [ShardClient(i, 0, f"127.0.0.1:{7100 + i}", f"w{i}", None) for i in range(n)]


def test_a_step_call_settles_then_cancels_after_a_failure_and_gives_up_at_its_backstop() -> None:
    answered, failing, silent = Future(), Future(), Future()  # futures nobody runs: only cancel ends `silent`
    done = threading.Event()
    call = StepCall(list(zip(_shards(3), (answered, failing, silent), strict=True)), 0, 5.0, done.set)
    answered.set_result(worker_pb2.StepResponse(step_id=1))
    failing.set_exception(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Connection refused"))
    assert not call.done()  # the silent shard gets SETTLE_S to finish the step
    assert done.wait(WAIT_S) and silent.cancelled()
    with pytest.raises(ShardFailure, match=r"^worker 127.0.0.1:7101 \(stage 1, tp rank 0\) lost: UNAVAILABLE: "):
        call.result()

    never = Future()
    call = StepCall(list(zip(_shards(1), (never,), strict=True)), 0, 2.0, lambda: None)
    call.expire_if_overdue(time.monotonic())
    assert not call.done()
    never.set_running_or_notify_cancel()  # running: cancel() cannot end it any more
    call.expire_if_overdue(call.deadline)
    assert call.done()
    with pytest.raises(ShardFailure, match=r"lost: TimeoutError: no answer within 2 s$"):
        call.result()


class OrderedShard(FakeShard):
    """A fake shard that runs steps in `after_step_id` order like a worker, can hold a step (`holds`),
    and records every Release of a slot that a step it has received and not finished still uses:
    the race the scheduler must never cause."""

    def __init__(self, mesh: FakeMesh, stage: int, tp_rank: int) -> None:
        super().__init__(mesh, stage, tp_rank)
        self.order = StepOrder(arrival_timeout_s=WAIT_S)
        self.holds: dict[int, threading.Event] = {}
        self.busy: dict[int, int] = {}  # slot -> steps received and not finished that use it
        self.races: list[str] = []

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        with self.lock:
            for e in req.entries:
                self.busy[e.slot] = self.busy.get(e.slot, 0) + 1
        try:
            with self.order.turn(req.step_id, req.after_step_id):
                hold = self.holds.get(req.step_id)
                if hold is not None:
                    assert hold.wait(WAIT_S)
                return super().step(req)
        finally:
            with self.lock:
                for e in req.entries:
                    self.busy[e.slot] -= 1

    def release(self, req: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        with self.lock:
            self.races += [f"{s.request_id}@{s.slot}" for s in req.sequences if self.busy.get(s.slot)]
        return super().release(req)


def ordered_mesh(**kw: Any) -> FakeMesh:
    mesh = FakeMesh(**kw)
    mesh.shards = [OrderedShard(mesh, sh.stage, sh.tp_rank) for sh in mesh.shards]
    return mesh


@pytest.mark.parametrize(("pp", "depth"), [(1, 0), (2, 0), (2, 1)], ids=["pp1", "pp2-full", "pp2-turns"])
def test_one_micro_batch_in_flight_per_stage(model_files: ModelFiles, pp: int, depth: int) -> None:
    """depth 0 (the default): one step in flight per stage; 1 (`up --pipeline turns`): the stages take turns."""
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0, pipeline_depth=depth),
                          structlog.wrap_logger(structlog.ReturnLogger()))  # fmt: skip
    scheduler.start()
    try:
        _micro_batches(scheduler, model_files, pp, depth or pp)
    finally:
        scheduler.shutdown(grace=0.0)


def _micro_batches(scheduler: Scheduler, model_files: ModelFiles, pp: int, in_flight: int) -> None:
    mesh = ordered_mesh(pp=pp, tp=1, kv_slots=4)
    mesh.gate = threading.Event()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    handles = [scheduler.submit(request(model_files, "a", "hello", max_new=4))]
    assert mesh.entered.wait(WAIT_S)  # a's prompt is in flight, held on every shard
    handles += [scheduler.submit(request(model_files, rid, "yo", max_new=4)) for rid in ("b", "c")]
    # b and c hold slots; with two in flight their prompts are already in flight next to a's, with one they wait.
    wait_until(lambda: scheduler.load()[1] == 3 and scheduler.pipeline_stats().steps == in_flight)
    time.sleep(0.1)  # room for a step too many to be dispatched, were the depth not kept
    assert scheduler.pipeline_stats().steps == in_flight
    mesh.gate.set()
    assert [len(tokens(collect(h))) for h in handles] == [4, 4, 4]
    stats = scheduler.pipeline_stats()
    assert stats.max_in_flight == in_flight and (stats.overlapped > 0) == (in_flight > 1)
    for shard in mesh.shards:
        steps = shard.steps  # in the order the shard ran them
        assert [s.step_id for s in steps] == list(range(1, len(steps) + 1))
        assert [s.after_step_id for s in steps] == list(range(len(steps)))  # each after the one sent before
        wait_until(lambda shard=shard: sorted(shard.released_ids()) == ["a", "b", "c"])
        assert shard.races == [] and shard.slots == {}
    if in_flight == 2:  # two micro-batches while a's prompt was held: a alone, then b (with c, if it came in time:
        # tokenizing c releases the interpreter lock, so the scheduler may dispatch b before c is queued)
        batches = [sorted(e.request_id for e in s.entries) for s in mesh.shards[0].steps]
        assert batches[0] == ["a"] and batches[1] in (["b"], ["b", "c"])


@pytest.mark.parametrize("placement", ["epoch-2", "epoch-1"], ids=["new-placement", "same-placement"])
def test_a_failure_resumes_every_micro_batch_in_its_slot_after_their_steps(
    scheduler: Scheduler, model_files: ModelFiles, placement: str
) -> None:
    """The repaired mesh may be other workers (a new epoch) or, after a transient failure, the same ones under a
    newer version: the sequences take their slots back (nothing is released: the workers that survived may keep
    their caches there), and the new chain starts only once every old step is over."""
    mesh = ordered_mesh(pp=2, tp=1, kv_slots=2)
    mesh.default_script = list(range(10, 30))
    last = mesh.shards[1]
    assert isinstance(last, OrderedShard)
    mesh.gate = threading.Event()
    last.holds[2] = threading.Event()  # b's step stays in flight on the last stage
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    a = scheduler.submit(request(model_files, "a", max_new=20))
    assert mesh.entered.wait(WAIT_S)
    b = scheduler.submit(request(model_files, "b", max_new=20))
    wait_until(lambda: scheduler.pipeline_stats().steps == 2)
    mesh.failures[(1, 0)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")  # step 1 fails on the last stage
    mesh.gate.set()
    # Neither fails: both wait to resume.
    wait_until(lambda: not scheduler.snapshot()[1])
    last.holds[2].set()
    assert a.events.empty() and b.events.empty()  # no token, no error: the failed step answered nothing
    # A repaired mesh: a new chain (after_step_id 0) once every old step is over; a and b replay and go on.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement=placement))
    for handle in (a, b):
        events = collect(handle)
        assert finish(events) is FinishReason.LENGTH
        assert [e.token_id for e in events if isinstance(e, TokenEvent)] == list(range(10, 30))  # none twice
    first_after = next(s for s in mesh.shards[0].steps if s.topology_version == 2)
    assert first_after.after_step_id == 0
    slots = {e.request_id: e.slot for s in mesh.shards[0].steps for e in s.entries}  # the last slot each used
    assert {e.request_id: e.slot for s in mesh.shards[0].steps if s.topology_version == 1 for e in s.entries} == slots
    for shard in mesh.shards:  # released once each, when they end
        wait_until(lambda shard=shard: sorted(shard.released_ids()) == ["a", "b"])
        assert shard.races == []
    assert finish(collect(scheduler.submit(request(model_files, "c", max_new=2)))) is FinishReason.LENGTH
