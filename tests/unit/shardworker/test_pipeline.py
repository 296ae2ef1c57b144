"""The worker's half of a pipeline, on two real stage cores (pp=2) in this process over real Gloo links:
steps sent in reverse order run in chain order (the decode steps depend on the prefill's KV cache, so a
wrong order would change their tokens and logprobs), refusals map to FAILED_PRECONDITION, a new epoch
resets it.

`StepOrder` on its own is tested in test_ordering.py; the gateway's half (keeping steps in flight) in
tests/unit/gateway/test_pipeline.py; the whole path over real processes in tests/e2e/test_pipeline.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import structlog
import torch
import torch.distributed as dist

from shardmesh.core.config import ModelConfig
from shardmesh.core.layout import split_layers
from shardmesh.core.topology import ModelSpec, Rendezvous, ServingLimits, ShardAssignment, ShardState, Stage, Topology
from shardmesh.proto.v1 import worker_pb2
from shardmesh.rpc.interceptors import ErrorInterceptor
from shardworker.runtime import StageWorkerCore
from shardworker.servicer import SERVICE_NAME, StageWorkerServicer
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.waiting import wait_until

GREEDY = worker_pb2.TokenSampling(temperature=0.0, top_p=1.0)


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


def served_step(servicer: StageWorkerServicer, logger: Any) -> Callable[[Any, Any], Any]:
    """`servicer.Step` as the gRPC server calls it: behind the interceptor that turns refusals into statuses."""
    handler = grpc.unary_unary_rpc_method_handler(servicer.Step)
    details = SimpleNamespace(method=f"/{SERVICE_NAME}/Step", invocation_metadata=())
    return ErrorInterceptor(SERVICE_NAME, logger).intercept_service(lambda _: handler, details).unary_unary


class Cores:
    """Stage 0 and stage 1 of a pp=2 mesh, each a StageWorkerCore behind its servicer, in this process."""

    def __init__(self, model: Path, order_timeout_s: float) -> None:
        self.model = model
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
        logger = structlog.wrap_logger(structlog.ReturnLogger())
        self.cores = [StageWorkerCore(f"w{i}", torch.device("cpu"), logger, 30.0, order_timeout_s) for i in range(2)]
        self.steps = [served_step(StageWorkerServicer(core), logger) for core in self.cores]
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
                results[(rank, request.step_id)] = self.steps[rank](request, _Context())
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
