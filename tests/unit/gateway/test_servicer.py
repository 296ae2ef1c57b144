"""The gRPC servicer in process, over a fake mesh: Generate, GenerateStream, GetModelInfo, health and
reflection, refusals as status codes naming the field, the queue limit, a client that cancels, and what
each RPC returns when the server shuts down.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.process import GatewayConfig, GatewayServer
from gateway.service_name import SERVICE_NAME
from gateway.watcher import ModelFiles
from shardmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.unit.gateway.fakes import VOCAB, FakeMesh, FakeSource, LogLines, eos_of, ids_of, mesh_state
from tests.waiting import WAIT_S, wait_until


@pytest.fixture
def served(model_files: ModelFiles) -> Iterator[tuple[GatewayServer, FakeSource, FakeMesh, grpc.Channel, LogLines]]:
    logs = LogLines()
    source, mesh = FakeSource(), FakeMesh(pp=2, tp=2, kv_slots=2, max_context=48)
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator="unused:1", max_queue=4, default_max_new_tokens=8)
    server = GatewayServer(cfg, logs.logger, mesh_source=source)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, source, mesh, channel, logs
    finally:
        channel.close()
        server.stop(grace=0.0)


def _health(channel: grpc.Channel) -> list[int]:
    stub = health_pb2_grpc.HealthStub(channel)
    return [stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status for s in ("", SERVICE_NAME)]


def _rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_servicer_generate_stream_info_health_and_errors(served: Any, model_files: ModelFiles) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    _, source, mesh, channel, logs = served
    stub = gateway_pb2_grpc.GatewayStub(channel)
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(channel).get_services()
    assert _health(channel) == [not_serving, not_serving]
    err = _rpc_error(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="early"), timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details().startswith("no ready topology: ")
    assert _rpc_error(lambda: stub.GetModelInfo(gateway_pb2.GetModelInfoRequest())).code() == (
        grpc.StatusCode.UNAVAILABLE
    )

    source.publish(mesh_state(mesh, model_files))
    assert _health(channel) == [serving, serving]
    info = stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.ready, info.pp, info.tp, info.max_context, info.has_chat_template) == (True, 2, 2, 48, True)
    assert list(info.eos_token_ids) == [eos_of(model_files)] and info.model.vocab_size == VOCAB

    # Unary: tokens, logprobs, text, finish reason, usage, timings.
    eos = eos_of(model_files)
    mesh.script["u"] = [*ids_of(model_files, "Olá 👋"), eos]
    long_enough = gateway_pb2.SamplingParams(max_new_tokens=20)
    r = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="u", params=long_enough), timeout=5)
    assert r.request_id == "u" and r.text == "Olá 👋" and list(r.token_ids) == mesh.script["u"]
    assert r.finish_reason == common_pb2.FINISH_REASON_EOS and len(r.logprobs) == len(r.token_ids)
    assert common_pb2.FINISH_REASON_STOP == common_pb2.FINISH_REASON_EOS  # its first name still builds
    assert not r.top_logprobs  # not asked for
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (2, len(r.token_ids))
    assert len(r.timings.inter_token_ms) == len(r.token_ids) - 1 and r.timings.total_ms >= r.timings.queue_ms

    # Streaming: one message per token, text deltas add up, the summary only on the last message.
    mesh.script["s"] = ids_of(model_files, "Olá 👋 and more")
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    params = gateway_pb2.SamplingParams(max_new_tokens=12)
    stream = list(stub.GenerateStream(gateway_pb2.GenerateRequest(chat=chat, params=params, request_id="s"),
                                      timeout=5))  # fmt: skip
    assert [m.index for m in stream] == list(range(12)) and all(m.request_id == "s" for m in stream)
    assert "".join(m.text_delta for m in stream) == "Olá 👋 an"  # 12 byte tokens
    assert [m.HasField("summary") for m in stream] == [False] * 11 + [True]
    summary = stream[-1].summary
    assert summary.finish_reason == common_pb2.FINISH_REASON_LENGTH and summary.usage.completion_tokens == 12
    assert summary.usage.prompt_tokens == len(model_files.tokenizer.encode_chat([{"role": "user", "content": "hi"}]))

    # Refusals map to status codes naming the field; each is one JSON log line with the request id.
    err = _rpc_error(lambda: stub.Generate(gateway_pb2.GenerateRequest(
        prompt="hi", request_id="bad", params=gateway_pb2.SamplingParams(top_p=2.0)), timeout=5))  # fmt: skip
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("params.top_p:")
    assert ("request-id", "bad") in (err.trailing_metadata() or ())
    err = _rpc_error(lambda: list(stub.GenerateStream(gateway_pb2.GenerateRequest(prompt=""), timeout=5)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details() == "prompt: must not be empty"
    err = _rpc_error(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", request_id="r" * 129), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("request_id: at most 128")
    failures = [e for e in logs.events() if e["event"] == "request_failed"]
    assert [(e["request_id"], e["code"]) for e in failures[:2]] == [("early", "UNAVAILABLE")] * 1 + [
        ("bad", "INVALID_ARGUMENT")
    ]  # fmt: skip
    assert all("Traceback" not in json.dumps(e) for e in logs.events())

    # The topology becomes incomplete: NOT_SERVING again, and requests are refused.
    source.publish(mesh_state(mesh, model_files, seq=2, version=2, complete=False))
    assert _health(channel) == [not_serving, not_serving]
    assert not stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5).ready


def test_servicer_top_logprobs_stop_tokens_ignore_eos_and_finish_reasons(served: Any, model_files: ModelFiles) -> None:
    _, source, mesh, channel, _ = served
    stub = gateway_pb2_grpc.GatewayStub(channel)
    source.publish(mesh_state(mesh, model_files))
    eos, (h, i, bang) = eos_of(model_files), ids_of(model_files, "hi!")

    def generate(request_id: str, **params: Any) -> gateway_pb2.GenerateResponse:
        sampling = gateway_pb2.SamplingParams(max_new_tokens=6, **params)
        request = gateway_pb2.GenerateRequest(prompt="hi", request_id=request_id, params=sampling)
        return stub.Generate(request, timeout=5)

    # A stop token: returned in token_ids, not in the text; the alternatives come per token, most likely first.
    mesh.script["t"] = [h, i, bang, eos]
    r = generate("t", stop_token_ids=[bang], top_logprobs=3)
    assert (list(r.token_ids), r.text, r.finish_reason) == ([h, i, bang], "hi", common_pb2.FINISH_REASON_STOP_TOKEN)
    assert [[a.token_id for a in t.alternatives] for t in r.top_logprobs] == [[t, t + 1, t + 2] for t in (h, i, bang)]
    assert [t.alternatives[0].logprob for t in r.top_logprobs] == pytest.approx(list(r.logprobs))
    # ignore_eos: the end-of-sequence token is just a token; the length ends it
    mesh.script["i"] = [h, eos, i, eos, h, i]
    r = generate("i", ignore_eos=True)
    assert list(r.token_ids) == mesh.script["i"] and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
    mesh.script["e"] = [h, eos, i]
    assert generate("e", stop_token_ids=[i]).finish_reason == common_pb2.FINISH_REASON_EOS
    mesh.script["s"] = [h, i, bang]
    assert generate("s", stop=["i!"]).finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    # Streamed: each message carries its token's alternatives.
    mesh.script["st"] = [h, i, eos]
    request = gateway_pb2.GenerateRequest(prompt="hi", request_id="st", params=gateway_pb2.SamplingParams(
        max_new_tokens=6, top_logprobs=2, repetition_penalty=1.2, frequency_penalty=0.5))  # fmt: skip
    stream = list(stub.GenerateStream(request, timeout=5))
    assert [[a.token_id for a in m.top_logprobs] for m in stream] == [[t, (t + 1) % VOCAB] for t in (h, i, eos)]
    assert stream[-1].summary.finish_reason == common_pb2.FINISH_REASON_EOS
    # The worker is told the penalties, the alternatives and where the prompt ends.
    sent = next(e.sampling for step in mesh.shards[-1].steps for e in step.entries if e.request_id == "st")
    assert (sent.top_logprobs, sent.frequency_penalty, sent.prompt_tokens) == (2, 0.5, 2)
    assert sent.repetition_penalty == pytest.approx(1.2)
    # Out of range: INVALID_ARGUMENT naming the field.
    for params, field in (({"frequency_penalty": 2.5}, "params.frequency_penalty"),
                          ({"min_p": -0.5}, "params.min_p"), ({"top_logprobs": 21}, "params.top_logprobs"),
                          ({"stop_token_ids": [1, VOCAB]}, "params.stop_token_ids[1]")):  # fmt: skip
        err = _rpc_error(lambda params=params: generate("bad", **params))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"{field}: "), field


def test_servicer_queue_full_and_client_cancel(served: Any, model_files: ModelFiles) -> None:
    server, source, mesh, channel, logs = served
    stub = gateway_pb2_grpc.GatewayStub(channel)
    source.publish(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    params = gateway_pb2.SamplingParams(max_new_tokens=30)

    def stream(request_id: str) -> Any:
        return stub.GenerateStream(gateway_pb2.GenerateRequest(prompt="hi", request_id=request_id, params=params))

    # c0's first step is held; c1 takes the second slot (its step goes in flight next to c0's: pp=2 keeps
    # two), the other four fill the queue.
    calls = [stream("c0")]
    assert mesh.entered.wait(WAIT_S)
    calls += [stream(f"c{i}") for i in range(1, 6)]
    wait_until(lambda: server.scheduler.load()[:2] == (4, 2))  # (waiting, running): all five submitted
    err = _rpc_error(lambda: stub.Generate(gateway_pb2.GenerateRequest(prompt="hi"), timeout=5))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.details()
    mesh.gate.set()
    first = next(calls[0])
    assert first.index == 0
    calls[0].cancel()  # the client goes away mid-stream
    for shard in mesh.shards:
        wait_until(lambda shard=shard: "c0" in shard.released_ids())
    for call in calls[1:]:
        assert list(call)[-1].summary.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert any(e["event"] == "request_cancelled" and e["request_id"] == "c0" for e in logs.events())


def test_shutdown_cancels_unary_with_partial_result(model_files: ModelFiles) -> None:
    logs = LogLines()
    mesh = FakeMesh(pp=1, tp=1)
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator="unused:1", shutdown_grace=0.3)
    server = GatewayServer(cfg, logs.logger, mesh_source=FakeSource(mesh_state(mesh, model_files)))
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = gateway_pb2.SamplingParams(max_new_tokens=40)
        mesh.step_delay = 0.05  # 40 tokens take 2 s: longer than the grace
        unary = stub.Generate.future(gateway_pb2.GenerateRequest(prompt="hi", params=params, request_id="unary"),
                                     timeout=10)  # fmt: skip
        stream = stub.GenerateStream(gateway_pb2.GenerateRequest(prompt="hi", params=params, request_id="stream"),
                                     timeout=10)  # fmt: skip
        assert next(stream).index == 0
        server.stop()  # the grace ends before the 40 tokens do: both requests end cancelled, part-way
        r = unary.result(timeout=5)
        assert r.finish_reason == common_pb2.FINISH_REASON_CANCELLED and 0 < len(r.token_ids) < 40
        err = _rpc_error(lambda: list(stream))
        assert err.code() == grpc.StatusCode.CANCELLED
    assert sorted(mesh.shards[0].released_ids()) == ["stream", "unary"]
