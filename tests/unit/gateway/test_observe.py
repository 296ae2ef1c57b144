"""The gateway's conventions of the ecosystem, through a real `GatewayServer` over a fake mesh: OpenTelemetry GenAI
attributes on the request span (spans kept by an in-memory exporter), the KV-cache usage ratio and the standard
`process_*` metrics in its `/metrics`."""

from __future__ import annotations

import dataclasses
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from gateway.observe import GatewayMetrics, genai_request
from gateway.process import GatewayConfig, GatewayServer
from gateway.requests import PreparedRequest, Sampling
from gateway.watcher import ModelFiles
from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from shardmesh.rpc import telemetry
from tests.unit.gateway import fakes
from tests.unit.gateway.fakes import FakeMesh, FakeSource, LogLines, ids_of, mesh_state
from tests.waiting import WAIT_S, wait_until

SERVED = "tiny-org/tiny-llama"


@pytest.fixture
def traced(model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch,
           request: pytest.FixtureRequest) -> Iterator[tuple[Any, ...]]:  # fmt: skip
    """A gateway with tracing (into memory) and metrics on, serving a 2 × 2 fake mesh of 2 KV slots (with
    `--served-model-name` when parametrized indirectly with one)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    step = fakes._FutureMethod.future  # a real stub also takes the step's trace context as metadata
    monkeypatch.setattr(fakes._FutureMethod, "future", lambda self, request, timeout=None, metadata=None: step(
        self, request, timeout))  # fmt: skip
    source, mesh = FakeSource(), FakeMesh(pp=2, tp=2, kv_slots=2, max_context=48)
    state = mesh_state(mesh, model_files)
    topology = state.topology
    model = dataclasses.replace(topology.model, served_model_name=SERVED)  # the coordinator's --model as given
    source.publish(dataclasses.replace(state, topology=dataclasses.replace(topology, model=model)))
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator="unused:1", default_max_new_tokens=8, metrics_port=-1,
                        served_model_name=getattr(request, "param", None))  # fmt: skip
    server = GatewayServer(cfg, LogLines().logger, mesh_source=source)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield gateway_pb2_grpc.GatewayStub(channel), mesh, exporter, server
    finally:
        channel.close()
        server.stop(grace=0.0)
        provider.shutdown()


def _request_span(exporter: InMemorySpanExporter, request_id: str) -> Any:
    def ended() -> list[Any]:
        return [s for s in exporter.get_finished_spans() if s.name.startswith("shardmesh.v1.Gateway/")
                and s.attributes.get("shardmesh.request_id") == request_id]  # fmt: skip

    wait_until(lambda: len(ended()) == 1)  # the span ends just after the response is sent
    return ended()[0]


def _genai(span: Any) -> dict[str, Any]:
    return {k: (tuple(v) if isinstance(v, tuple | list) else v) for k, v in span.attributes.items()
            if k.startswith("gen_ai.")}  # fmt: skip


@pytest.mark.parametrize("traced", ["alias"], indirect=True)
def test_a_served_model_name_is_the_model_on_grpc_spans_too(traced: tuple[Any, ...], model_files: ModelFiles) -> None:
    stub, mesh, exporter, _ = traced
    mesh.script["named"] = ids_of(model_files, "ab")
    params = gateway_pb2.SamplingParams(max_new_tokens=2)
    stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="named", params=params), timeout=WAIT_S)
    assert _genai(_request_span(exporter, "named"))["gen_ai.request.model"] == "alias"  # not the coordinator's name


def test_request_spans_carry_the_genai_attributes(traced: tuple[Any, ...], model_files: ModelFiles) -> None:
    stub, mesh, exporter, _ = traced
    mesh.script["text"] = ids_of(model_files, "abc")
    params = gateway_pb2.SamplingParams(max_new_tokens=3, temperature=0.5, top_p=0.9, top_k=40, seed=7, stop=["zz"])
    r = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="text", params=params), timeout=WAIT_S)
    assert _genai(_request_span(exporter, "text")) == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": SERVED,
        "gen_ai.request.max_tokens": 3, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": pytest.approx(0.9),
        "gen_ai.request.top_k": 40, "gen_ai.request.seed": 7, "gen_ai.request.stop_sequences": ("zz",),
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": r.usage.prompt_tokens, "gen_ai.usage.output_tokens": 3,
    }  # fmt: skip

    # A conversation, streamed, with the defaults: a chat of the gateway's default length, greedy.
    mesh.script["chat"] = [*ids_of(model_files, "ok"), *model_files.eos_token_ids]
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    stream = list(stub.GenerateStream(gateway_pb2.GenerateRequest(chat=chat, request_id="chat"), timeout=WAIT_S))
    usage = stream[-1].summary.usage
    assert _genai(_request_span(exporter, "chat")) == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": SERVED, "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0, "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": usage.prompt_tokens, "gen_ai.usage.output_tokens": usage.completion_tokens,
    }  # fmt: skip
    assert usage.completion_tokens == len(ids_of(model_files, "ok")) + 1

    # A refused request: the error's type (its status code) and nothing about a response.
    with pytest.raises(grpc.RpcError):
        stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="bad", params=gateway_pb2.SamplingParams(
            max_new_tokens=1, top_p=2.0)), timeout=WAIT_S)  # fmt: skip
    span = _request_span(exporter, "bad")
    assert span.attributes["error.type"] == "INVALID_ARGUMENT" and _genai(span) == {}


def _metrics(server: GatewayServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def test_kv_cache_usage_ratio_and_process_metrics(traced: tuple[Any, ...], model_files: ModelFiles) -> None:
    stub, mesh, _, server = traced
    before = _metrics(server)
    assert before["shardmesh_kv_cache_usage_ratio"] == 0.0 and before["process_cpu_seconds_total"] > 0
    assert before["process_resident_memory_bytes"] > 0 and before["process_open_fds"] > 0
    mesh.gate = threading.Event()  # hold the first step: the request holds one of the 2 slots meanwhile
    mesh.script["held"] = ids_of(model_files, "abc")
    params = gateway_pb2.SamplingParams(max_new_tokens=3)
    call = stub.Generate.future(gateway_pb2.GenerateRequest(prompt="hi", request_id="held", params=params),
                                timeout=WAIT_S)  # fmt: skip
    assert mesh.entered.wait(WAIT_S)
    held = _metrics(server)
    assert held["shardmesh_kv_cache_usage_ratio"] == 0.5 and held["shardmesh_free_kv_slots"] == 1
    mesh.gate.set()
    assert len(call.result().token_ids) == 3
    wait_until(lambda: _metrics(server)["shardmesh_free_kv_slots"] == 2)  # released after the response
    assert _metrics(server)["shardmesh_kv_cache_usage_ratio"] == 0.0


def _labeled(server: GatewayServer, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of `name` in the gateway's /metrics, keyed by their labels (`_key`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=WAIT_S) as r:
        text = r.read().decode()
    return {_key(**s.labels): s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}  # fmt: skip


def _key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_request_metrics_carry_the_served_model_name(traced: tuple[Any, ...], model_files: ModelFiles) -> None:
    """Without --served-model-name the label is the coordinator's name for the model (its --model as given)."""
    stub, mesh, _, server = traced
    served = _key(model_name=SERVED)
    assert _labeled(server, "shardmesh_generated_tokens_total") == {served: 0.0}  # at 0 from the first topology
    mesh.script["done"] = ids_of(model_files, "abc")
    params = gateway_pb2.SamplingParams(max_new_tokens=3)
    r = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="done", params=params), timeout=WAIT_S)
    with pytest.raises(grpc.RpcError):
        stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", params=gateway_pb2.SamplingParams(top_p=2.0)),
                      timeout=WAIT_S)  # fmt: skip
    assert _labeled(server, "shardmesh_requests_total") == {
        _key(model_name=SERVED, outcome="length"): 1.0,
        _key(model_name=SERVED, outcome="invalid_argument"): 1.0,
    }
    assert _labeled(server, "shardmesh_generated_tokens_total") == {served: 3.0}
    assert _labeled(server, "shardmesh_prompt_tokens_total") == {served: float(r.usage.prompt_tokens)}
    assert _labeled(server, "shardmesh_time_to_first_token_seconds_count") == {served: 1.0}
    assert _labeled(server, "shardmesh_inter_token_latency_seconds_count") == {served: 2.0}
    assert _labeled(server, "shardmesh_queue_wait_seconds_count") == {served: 1.0}
    assert _labeled(server, "shardmesh_request_duration_seconds_count") == {
        _key(model_name=SERVED, finish_reason="length"): 1.0}  # fmt: skip
    assert _labeled(server, "shardmesh_batch_size_count") == {(): 3.0}  # the mesh's own metrics: no label


def test_the_model_name_label_is_the_served_name_when_one_is_set(model_files: ModelFiles) -> None:
    metrics = GatewayMetrics(lambda: (0, 0, 1, True), "chat")
    state = mesh_state(FakeMesh(), model_files)
    topology = dataclasses.replace(state.topology, model=dataclasses.replace(state.topology.model,
                                                                             served_model_name=SERVED))  # fmt: skip
    metrics.mesh_changed(dataclasses.replace(state, topology=topology))
    assert metrics.model_name == "chat"
    assert metrics.registry.get_sample_value("shardmesh_generated_tokens_total", {"model_name": "chat"}) == 0.0
    following = GatewayMetrics(lambda: (0, 0, 1, True))
    assert following.model_name == "" and following.registry.get_sample_value(
        "shardmesh_generated_tokens_total", {"model_name": ""}) is None  # fmt: skip
    following.mesh_changed(dataclasses.replace(state, topology=topology))
    assert following.model_name == SERVED
    following.mesh_changed(dataclasses.replace(state, topology=None))  # the coordinator lost: the name stays
    assert following.model_name == SERVED


def test_kv_usage_is_zero_while_no_mesh_serves() -> None:
    load = [(0, 0, 0, False)]
    metrics = GatewayMetrics(lambda: load[0])
    value = lambda: metrics.registry.get_sample_value("shardmesh_kv_cache_usage_ratio")  # noqa: E731
    assert value() == 0.0  # no step yet: the mesh's slots are not known
    metrics.kv_slots = 4
    assert value() == 0.0  # not ready: no mesh serves (free slots read 0 then)
    load[0] = (2, 3, 1, True)
    assert value() == 0.75
    load[0] = (0, 0, 4, True)
    assert value() == 0.0


def test_genai_attributes_leave_out_what_was_not_asked() -> None:
    req = PreparedRequest("r", (1, 2), 5, Sampling(), (), frozenset(), None, 0.0)
    assert genai_request("token_ids", req, "") == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 1.0,
    }  # fmt: skip
