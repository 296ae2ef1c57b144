"""A full pipeline over real processes: pipelined batched greedy decode over pp=2 equals each request
alone and `transformers`, and the workers' trace spans show stage 0 running a step while stage 1 still
runs the one before. (Each half on its own: tests/unit/shardworker/test_pipeline.py, the worker's;
tests/unit/gateway/test_pipeline.py, the gateway's.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh_cli.up import free_port, wait_serving
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.otlp import Collector, GrpcReceiver, Span
from tests.stack import Stack


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # eos 95 is rare under this seed, so most answers run to max_new_tokens and compare many tokens.
    return make_checkpoint(tmp_path_factory.mktemp("pipe"), "llama-gqa-tied", num_layers=4, seed=11, eos_token_id=95)


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
