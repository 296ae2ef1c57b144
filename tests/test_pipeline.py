"""A full pipeline: with pp stages the gateway keeps up to pp steps (micro-batches) in flight, and every
worker runs them in the order `after_step_id` chains them, whatever order their RPCs arrive in.
(`StepOrder` on its own, the worker's half of the ordering, is tested in tests/test_ordering.py.)

- `StepCall`: after a failure the other shards settle, then are cancelled; a silent one hits the backstop.
- Two real stage cores (pp=2) in this process over real Gloo links: steps sent in reverse order
  run in chain order (the decode steps depend on the prefill's KV cache, so a wrong order would
  change their tokens and logprobs), refusals map to FAILED_PRECONDITION, a new epoch resets it.
- The scheduler over fake shards that keep the order like workers: two micro-batches in flight at
  pp=2 (one at pp=1), the chain, and a failure that fails both micro-batches but releases a slot
  only once no step in flight uses it.
- Real processes: pipelined batched greedy decode over pp=2 equals each request alone and
  `transformers`, and the workers' trace spans show stage 0 running a step while stage 1 still
  runs the one before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
import torch
import torch.distributed as dist

from gateway.fanout import ShardClient, ShardFailure, StepCall
from gateway.results import EndEvent, FinishReason
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from shardmesh.core.config import ModelConfig
from shardmesh.core.errors import Unavailable
from shardmesh.core.layout import split_layers
from shardmesh.core.topology import ModelSpec, Rendezvous, ServingLimits, ShardAssignment, ShardState, Stage, Topology
from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2
from shardmesh_cli.up import free_port, wait_serving
from shardworker.ordering import StepOrder
from shardworker.runtime import StageWorkerCore
from shardworker.servicer import StageWorkerServicer
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.otlp import Collector, GrpcReceiver, Span
from tests.stack import Stack
from tests.test_gateway import (
    WAIT_S,
    FakeMesh,
    FakeRpcError,
    FakeShard,
    collect,
    finish,
    mesh_state,
    request,
    tokens,
    wait_until,
    write_tokenizer,
)

GREEDY = worker_pb2.TokenSampling(temperature=0.0, top_p=1.0)


# -- two real stage cores in this process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so most answers run to max_new_tokens and compare many tokens.
    return make_checkpoint(tmp_path_factory.mktemp("pipe"), "llama-gqa-tied", num_layers=4, seed=11, eos_token_id=95)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class _Context:
    """What the Step handler asks of a grpc.ServicerContext."""

    def invocation_metadata(self) -> tuple:
        return ()

    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def pp2_topology(model: Path, store_port: int, epoch: int) -> Topology:
    cfg = ModelConfig.from_dir(model)
    stages = tuple(Stage(i, start, end, (ShardAssignment(0, i, f"w{i}", "", ShardState.READY),))
                   for i, (start, end) in enumerate(split_layers(cfg.num_layers, 2)))  # fmt: skip
    spec = ModelSpec(str(model), "float32", "LlamaForCausalLM", cfg.num_layers, cfg.hidden_size, cfg.vocab_size, 64)
    return Topology(epoch, spec, 2, 1, stages, Rendezvous.for_epoch("127.0.0.1", store_port, epoch, 2), True,
                    ServingLimits(4, 64, 64))  # fmt: skip


class Cores:
    """Stage 0 and stage 1 of a pp=2 mesh, each a StageWorkerCore behind its servicer, in this process."""

    def __init__(self, model: Path, order_timeout_s: float) -> None:
        self.model = model
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        logger = structlog.wrap_logger(structlog.ReturnLogger())
        self.cores = [StageWorkerCore(f"w{i}", torch.device("cpu"), logger, 30.0, order_timeout_s) for i in range(2)]
        self.servicers = [StageWorkerServicer(core) for core in self.cores]
        self.apply(1)

    def apply(self, epoch: int) -> None:
        """Both cores join `epoch` (forming groups needs both at once)."""
        topology = pp2_topology(self.model, self.store.port, epoch)
        threads = [threading.Thread(target=core.apply, args=(topology,)) for core in self.cores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(core.state is ShardState.READY for core in self.cores), [core.detail for core in self.cores]

    def waiting(self, rank: int) -> int:
        rt = self.cores[rank]._runtime
        return rt.order.waiting() if rt is not None else 0

    def send(self, request: worker_pb2.StepRequest, results: dict[tuple[int, int], Any],
             ranks: tuple[int, ...] = (0, 1)) -> list[threading.Thread]:  # fmt: skip
        """`request` to each rank on its own thread, as gRPC would; answers (or Aborted) in `results`."""

        def call(rank: int) -> None:
            try:
                results[(rank, request.step_id)] = self.servicers[rank].Step(request, _Context())
            except Aborted as e:
                results[(rank, request.step_id)] = e

        threads = [threading.Thread(target=call, args=(rank,)) for rank in ranks]
        for t in threads:
            t.start()
        return threads


@pytest.fixture
def cores(model: Path) -> Cores:
    return Cores(model, order_timeout_s=0.5)


def entry(rid: str, slot: int, start: int, ids: list[int]) -> worker_pb2.BatchEntry:
    return worker_pb2.BatchEntry(request_id=rid, slot=slot, start_pos=start, num_tokens=len(ids), token_ids=ids,
                                 sampling=GREEDY)  # fmt: skip


def step(step_id: int, after: int, *entries: worker_pb2.BatchEntry, version: int = 1) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(step_id=step_id, topology_version=version, after_step_id=after, entries=entries)


def logprob(logits: torch.Tensor, token: int) -> float:
    return torch.log_softmax(logits, -1)[token].item()


PROMPT = [1, 17, 5, 42, 33, 8]


def test_steps_sent_newest_first_run_in_chain_order(cores: Cores, model: Path) -> None:
    ref, ref_logits = reference_greedy(model, PROMPT, 3)
    n = len(PROMPT)
    chain = [step(1, 0, entry("x", 0, 0, PROMPT)), step(2, 1, entry("x", 0, n, [ref[0]])),
             step(3, 2, entry("x", 0, n + 1, [ref[1]]))]  # fmt: skip
    results: dict[tuple[int, int], Any] = {}
    threads = []
    for arrived, req in enumerate(reversed(chain), start=1):  # step 3 first, then 2, then 1
        threads += cores.send(req, results)
        if req.after_step_id:
            wait_until(lambda n=arrived: cores.waiting(0) == n and cores.waiting(1) == n)
    for t in threads:
        t.join(30)
    assert not any(isinstance(r, Aborted) for r in results.values()), results
    # The decode steps read the prefill's KV cache: run before it, their logits would be another's.
    got = [results[(1, i)].tokens[0] for i in (1, 2, 3)]
    assert [t.token_id for t in got] == ref
    want = [logprob(ref_logits[0][-1], ref[0]), logprob(ref_logits[1], ref[1]), logprob(ref_logits[2], ref[2])]
    assert max(abs(t.logprob - w) for t, w in zip(got, want, strict=True)) < 1e-4
    assert all(results[(rank, i)].order_wait_ms > 0 for rank in (0, 1) for i in (2, 3))  # they arrived first


def test_a_missing_predecessor_is_failed_precondition_and_a_new_chain_runs(cores: Cores, model: Path) -> None:
    results: dict[tuple[int, int], Any] = {}
    for t in cores.send(step(100, 99, entry("y", 1, 0, PROMPT)), results):
        t.join(30)
    for rank in (0, 1):
        e = results[(rank, 100)]
        assert isinstance(e, Aborted) and e.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.details == "after_step_id: step 99 did not arrive within 0.5 s (last step run here: none)"
    for t in cores.send(step(101, 0, entry("y", 1, 0, PROMPT)), results):  # the worker is not stuck
        t.join(30)
    assert results[(1, 101)].tokens[0].token_id == reference_greedy(model, PROMPT, 1)[0][0]


def test_a_new_epoch_fails_steps_waiting_in_the_old_one(model: Path) -> None:
    cores = Cores(model, order_timeout_s=60.0)  # the old epoch's waiter must end long before this
    results: dict[tuple[int, int], Any] = {}
    started = time.monotonic()
    waiter = cores.send(step(7, 6, entry("z", 2, 0, PROMPT)), results, ranks=(0,))
    wait_until(lambda: cores.waiting(0) == 1)
    cores.apply(2)  # a placement change: new groups, a new order
    waiter[0].join(30)
    e = results[(0, 7)]
    assert isinstance(e, Aborted) and e.code == grpc.StatusCode.FAILED_PRECONDITION
    assert e.details == "after_step_id: step 6 will not run here: this worker left epoch 1"
    assert time.monotonic() - started < 30
    for t in cores.send(step(1, 0, entry("z", 2, 0, PROMPT), version=2), results):
        t.join(30)
    assert results[(1, 1)].tokens[0].token_id == reference_greedy(model, PROMPT, 1)[0][0]


# -- the scheduler over fake shards that keep the order --------------------------------------------------


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


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    return ModelFiles.load(str(write_tokenizer(tmp_path_factory.mktemp("tok") / "model")))


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    s = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), structlog.wrap_logger(structlog.ReturnLogger()))
    s.start()
    yield s
    s.shutdown(grace=0.0)


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
    if in_flight == 2:  # two micro-batches while a's prompt was held: a alone, then b and c (ceil(3 / 2) = 2)
        batches = [sorted(e.request_id for e in s.entries) for s in mesh.shards[0].steps]
        assert batches[:2] == [["a"], ["b", "c"]]


def test_a_failure_fails_every_micro_batch_and_releases_after_their_steps(
    scheduler: Scheduler, model_files: ModelFiles
) -> None:
    mesh = ordered_mesh(pp=2, tp=1, kv_slots=2)
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
    message = "worker 127.0.0.1:7010 (stage 1, tp rank 0) lost: UNAVAILABLE: Connection refused"
    for handle in (a, b):  # both fail at once, b while its step is still in flight
        end = collect(handle)[-1]
        assert isinstance(end, EndEvent) and isinstance(end.error, Unavailable) and str(end.error) == message
    for shard in mesh.shards:
        wait_until(lambda shard=shard: shard.released_ids() == ["a"])
    assert all("b" not in shard.released_ids() for shard in mesh.shards)  # its step has not completed
    last.holds[2].set()
    for shard in mesh.shards:
        wait_until(lambda shard=shard: shard.released_ids() == ["a", "b"])
        assert shard.races == []
    # A repaired mesh: a new chain (after_step_id 0) once every old step is over.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    assert finish(collect(scheduler.submit(request(model_files, "c", max_new=2)))) is FinishReason.LENGTH
    first_of_c = next(s for s in mesh.shards[0].steps if s.entries[0].request_id == "c")
    assert first_of_c.after_step_id == 0 and first_of_c.topology_version == 2


# -- real processes ----------------------------------------------------------------------------------------

PROMPTS = [[1, 17, 5, 42, 33, 8], [1, 9, 9, 2, 60], [1, 70, 71], [1, 3, 5, 7, 11, 13, 17, 19], [1, 4, 4, 4],
           [1, 88, 12, 6, 30, 2, 9, 14, 50]]  # fmt: skip
NEW_TOKENS = 16


class TracedMesh:
    """coordinator, 2 stage workers and a gateway, all exporting every step's spans to one receiver."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.collector = Collector()
        self.receiver = GrpcReceiver(self.collector)
        self.stack = Stack(log_dir)
        try:
            fast = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
            endpoint = self.receiver.endpoint
            # A small token budget chunks the longer prompts, so chunks and decodes share micro-batches.
            self.stack.start_coordinator(model, 2, 1, "--kv-slots", "8", "--max-context", "128",
                                         "--max-batch-tokens", "8")  # fmt: skip
            for w in ("w0", "w1"):
                self.stack.start_worker(w, "--otlp-endpoint", endpoint, env=fast)
            self.address = f"127.0.0.1:{free_port()}"
            self.stack.spawn("gateway", "gateway", "--listen", self.address, "--coordinator", self.stack.coordinator,
                             "--otlp-endpoint", endpoint.removeprefix("http://"), "--trace-decode-steps", "1000",
                             env=fast)  # fmt: skip
            self.stack.wait_complete(timeout=90)
            wait_serving(self.address, [("gateway", self.stack.procs["gateway"])], 60, log_dir)
            self.channel = grpc.insecure_channel(self.address)
            self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        except BaseException:
            self.close()
            raise

    def generate(self, ids: list[int]) -> list[int]:
        params = gateway_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
        r = self.stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), params=params),
                               timeout=60)  # fmt: skip
        return list(r.token_ids)

    def close(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        self.stack.close()
        self.receiver.close()


@pytest.fixture(scope="module")
def traced_mesh(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedMesh]:
    m = TracedMesh(model, tmp_path_factory.mktemp("pipe-logs"))
    yield m
    m.close()


def _concurrently(mesh: TracedMesh) -> dict[int, list[int]]:
    """Every prompt at once, the second half joining while the first half is decoding."""
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    decoding = threading.Event()

    def one(i: int) -> None:
        try:
            if i >= len(PROMPTS) // 2:
                assert decoding.wait(60)
            params = gateway_pb2.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
            req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=PROMPTS[i]), params=params)
            out = []
            for msg in mesh.stub.GenerateStream(req, timeout=120):
                out.append(msg.token_id)
                if len(out) == 2:
                    decoding.set()
            results[i] = out
        except BaseException as e:
            errors.append(e)
            decoding.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[0]
    return results


def _worker_steps(spans: list[Span]) -> dict[tuple[int, int], Span]:
    """(step id, stage) -> that stage's worker.step span (recorded once per traced request: same numbers)."""
    return {(s.attributes["shardmesh.step_id"], s.attributes["shardmesh.stage"]): s
            for s in spans if s.name == "worker.step"}  # fmt: skip


def test_pipelined_decode_equals_alone_and_transformers_and_stages_overlap(traced_mesh: TracedMesh,
                                                                           model: Path) -> None:  # fmt: skip
    reference = {i: reference_greedy(model, p, NEW_TOKENS)[0] for i, p in enumerate(PROMPTS)}
    alone = {i: traced_mesh.generate(p) for i, p in enumerate(PROMPTS)}
    together = _concurrently(traced_mesh)
    for i in range(len(PROMPTS)):
        assert together[i] == alone[i] == reference[i][: len(alone[i])], i
        assert len(alone[i]) == NEW_TOKENS or alone[i][-1] == 95  # ran to the length, or stopped at eos

    # The schedule, as the traces show it: gateway step spans sent while another step was in flight,
    # each after the one dispatched before it, and stage 0 starting a step (once its turn came)
    # before stage 1 finished the step before it. One step at a time would show neither.
    def settled(spans: list[Span]) -> bool:
        steps = {s.attributes["shardmesh.step_id"] for s in spans if s.name.startswith("step.")}
        workers = _worker_steps(spans)
        return bool(steps) and all((i, stage) in workers for i in steps for stage in (0, 1))

    spans = traced_mesh.collector.wait_for(settled)
    gateway_steps = {s.attributes["shardmesh.step_id"]: s for s in spans if s.name.startswith("step.")}
    assert max(s.attributes["shardmesh.step.in_flight"] for s in gateway_steps.values()) == 2
    workers = _worker_steps(spans)
    overlaps = []
    for (i, stage), s in workers.items():
        before = workers.get((s.attributes["shardmesh.step.after_step_id"], 1))
        if stage == 0 and before is not None:
            ran_from = s.start_ns + s.attributes["shardmesh.step.order_wait_ms"] * 1e6
            if ran_from < before.end_ns:
                overlaps.append(i)
    assert overlaps, "stage 0 never ran a step while stage 1 ran the one before"
    assert all(s.attributes["shardmesh.step.after_step_id"] == i - 1 for i, s in gateway_steps.items())
