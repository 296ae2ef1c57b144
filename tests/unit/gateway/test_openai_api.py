"""The OpenAI-compatible HTTP API in process, served by a `GatewayServer` over a fake mesh, through the official
`openai` client and raw HTTP: statuses for every refusal (503 before a mesh, 400, 401, 404, 429), health, a client
that goes away (streamed or not) cancelling its request, what a shutdown does to the requests running, request
spans, and the gateway's HTTP flags."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway import app
from gateway.process import GatewayConfig, GatewayServer
from gateway.watcher import ModelFiles
from shardmesh.rpc import telemetry
from shardmesh.rpc.flags import UsageError
from tests.unit.gateway import fakes
from tests.unit.gateway.fakes import FakeMesh, FakeSource, LogLines, eos_of, ids_of, mesh_state
from tests.waiting import WAIT_S, wait_until

HI = [{"role": "user", "content": "hi"}]


class Served:
    """A gateway with its HTTP API on a free port, over a fake mesh published by hand."""

    def __init__(self, files: ModelFiles, **cfg: Any) -> None:
        self.logs, self.source = LogLines(), FakeSource()
        self.mesh = FakeMesh(pp=1, tp=1, kv_slots=2, max_context=48)
        config = GatewayConfig(**{"listen": "127.0.0.1:0", "coordinator": "unused:1", "max_queue": 2,
                                  "default_max_new_tokens": 8, "http_listen": "127.0.0.1:0", **cfg})  # fmt: skip
        self.server = GatewayServer(config, self.logs.logger, mesh_source=self.source)
        self.server.start()
        self.files = files
        self.root = f"http://127.0.0.1:{self.server.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.root}/v1", api_key=cfg.get("api_key") or "unused", max_retries=0,
                                    timeout=WAIT_S)  # fmt: skip

    def publish(self) -> None:
        self.source.publish(mesh_state(self.mesh, self.files))

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        return _http(urllib.request.Request(self.root + path, headers=headers or {}))

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
        return _http(urllib.request.Request(self.root + path, data=data, method="POST", headers=headers))

    def events(self, name: str, request_id: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.logs.events()
                if e["event"] == name and (request_id is None or e.get("request_id") == request_id)]  # fmt: skip

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=0.0)


def _http(request: urllib.request.Request) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def served(model_files: ModelFiles) -> Iterator[Served]:
    s = Served(model_files)
    try:
        yield s
    finally:
        s.close()


def test_answers_refusals_and_health(served: Served, model_files: ModelFiles) -> None:
    # No mesh yet: /health and every request say 503, naming why.
    status, body = served.get("/health")
    assert status == 503 and body["error"]["message"].startswith("no ready topology")
    with pytest.raises(openai.InternalServerError) as e:
        served.client.chat.completions.create(model="m", messages=HI)
    assert e.value.status_code == 503 and e.value.body["code"] == "service_unavailable"
    assert served.get("/v1/models")[0] == 503  # no --served-model-name, and no topology to name the model yet

    served.publish()
    assert served.get("/health") == (200, {"status": "serving"})
    name = model_files.path  # the topology's model; its served_model_name is unset in the fake one
    assert [m.id for m in served.client.models.list()] == [name]

    # A whole answer, then the same streamed, with usage: the scheduler's tokens, text and finish reason.
    eos = eos_of(model_files)
    served.mesh.script["whole"] = [*ids_of(model_files, "Olá"), eos]
    answer = served.client.chat.completions.create(model=name, messages=HI, max_tokens=20, logprobs=True,
                                                   extra_headers={"X-Request-Id": "whole"})  # fmt: skip
    assert answer.id == "chatcmpl-whole" and answer.choices[0].message.content == "Olá"
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 5
    assert [t.logprob for t in answer.choices[0].logprobs.content] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    served.mesh.script["streamed"] = ids_of(model_files, "Olá and more")
    chunks = list(served.client.chat.completions.create(
        model=name, messages=HI, max_tokens=4, stream=True, stream_options={"include_usage": True},
        extra_headers={"X-Request-Id": "streamed"}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Olá"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 4
    completion = served.client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=2)
    filler = model_files.tokenizer.decode([served.mesh.filler] * 2)  # what the fake mesh draws past its script
    assert completion.choices[0].text == filler and completion.usage.prompt_tokens == 3

    # Refusals: 400 naming the field (never 422), 404 for another model, unknown paths and methods in the same shape.
    status, body = served.post("/v1/chat/completions", {"messages": HI, "top_p": 2}, {"X-Request-Id": "bad"})
    assert status == 400 and body["error"]["param"] == "top_p" and body["error"]["type"] == "invalid_request_error"
    assert served.post("/v1/chat/completions", {"messages": HI, "max_tokens": "many"})[1]["error"]["param"] == (
        "max_tokens")  # fmt: skip
    status, body = served.post("/v1/completions", b'{"prompt": ')
    assert status == 400 and body["error"]["message"].startswith("body: not valid JSON")
    status, body = served.post("/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"})
    assert status == 400 and "Content-Type: application/json" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        served.client.completions.create(model="other", prompt="x")
    assert e.value.body["param"] == "model" and "'other'" in e.value.body["message"]
    assert served.get("/v1/nothing")[0] == 404 and served.get("/v1/chat/completions")[0] == 405
    failed = served.events("request_failed", "bad")
    assert [(e["code"], e["api"]) for e in failed] == [("INVALID_ARGUMENT", "openai")]


def test_vllm_sampling_fields_reach_the_worker_and_top_logprobs_come_back(served: Served,
                                                                         model_files: ModelFiles) -> None:  # fmt: skip
    served.publish()
    eos, (h, i, bang) = eos_of(model_files), ids_of(model_files, "hi!")
    served.mesh.script["pen"] = [h, eos, i, bang, h]
    answer = served.client.chat.completions.create(
        model=None, messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2, frequency_penalty=0.5,
        presence_penalty=-0.5, extra_headers={"X-Request-Id": "pen"},
        extra_body={"repetition_penalty": 1.5, "min_p": 0.25, "ignore_eos": True, "stop_token_ids": [bang]},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.message.content == "hi" and choice.finish_reason == "stop"  # the stop token: neither eos nor text

    def token(t: int) -> str:
        return model_files.tokenizer.decode([t], skip_special_tokens=False)

    assert [[a.token for a in t.top_logprobs] for t in choice.logprobs.content] == [
        [token(t), token((t + 1) % fakes.VOCAB)] for t in (h, eos, i, bang)]  # fmt: skip
    sent = next(e.sampling for step in served.mesh.shards[0].steps for e in step.entries if e.request_id == "pen")
    assert (sent.temperature, sent.frequency_penalty, sent.presence_penalty, sent.repetition_penalty, sent.min_p,
            sent.top_logprobs) == (0.0, 0.5, -0.5, 1.5, 0.25, 2)  # fmt: skip
    status, body = served.post("/v1/completions", {"prompt": "x", "stop_token_ids": [fakes.VOCAB]})
    assert status == 400 and body["error"]["param"] == "stop_token_ids[0]"


def test_served_model_name_and_api_key(model_files: ModelFiles) -> None:
    s = Served(model_files, served_model_name="tiny-chat", api_key="sekret")
    try:
        s.publish()
        assert [m.id for m in s.client.models.list()] == ["tiny-chat"]
        assert s.client.completions.create(model="tiny-chat", prompt="x", max_tokens=1).model == "tiny-chat"
        with pytest.raises(openai.PermissionDeniedError) as e:  # a key, not accepted: 403
            s.client.with_options(api_key="wrong").models.list()
        assert e.value.status_code == 403 and e.value.body["code"] == "invalid_api_key"
        assert e.value.body["message"] == "API key not accepted"  # never how close it came
        status, body = s.get("/v1/models")  # no key at all: 401, saying how to send one
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert body["error"]["message"] == "no API key: send authorization: Bearer <key>"
        assert s.get("/health")[0] == 200  # health needs no key
    finally:
        s.close()


def test_queue_full_and_a_closed_stream_cancels(served: Served) -> None:
    served.publish()
    served.mesh.gate = threading.Event()  # steps wait here: requests stay where they are
    streams = []
    for i in range(4):  # two hold the KV slots, two wait: the queue (2) is full
        streams.append(served.client.chat.completions.create(model=None, messages=HI, max_tokens=20, stream=True,
                                                             extra_headers={"X-Request-Id": f"c{i}"}))  # fmt: skip
    wait_until(lambda: served.server.scheduler.load()[:3] == (2, 2, 0))  # (waiting, running, free slots)
    with pytest.raises(openai.RateLimitError) as e:
        served.client.chat.completions.create(model=None, messages=HI, max_tokens=20)
    assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"

    first = next(iter(streams[0]))  # the role: sent before any token
    assert first.choices[0].delta.role == "assistant"
    streams[0].close()  # the client goes away mid-stream
    wait_until(lambda: served.server.scheduler.load()[2] == 1)  # c0's slot counts as free: its handle is cancelled
    served.mesh.gate.set()
    shard = served.mesh.shards[0]
    wait_until(lambda: "c0" in shard.released_ids())
    assert served.events("request_cancelled", "c0")[0]["by"] == "client"
    for stream in streams[1:]:  # the others run to their length
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        assert finishes[-1] == "length"


def test_a_client_that_disconnects_cancels_a_whole_answer(served: Served) -> None:
    served.publish()
    served.mesh.gate = threading.Event()
    body = json.dumps({"messages": HI, "max_tokens": 20}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: gone\r\nContent-Length: %d\r\n\r\n" % len(body))  # fmt: skip
    with socket.create_connection(("127.0.0.1", served.server.http_port), timeout=WAIT_S) as s:
        s.sendall(head + body)
        wait_until(lambda: served.server.scheduler.load()[1] == 1)  # running (its first step held at the gate)
    wait_until(lambda: served.server.scheduler.load()[2] == 2)  # both slots count as free: it was cancelled
    served.mesh.gate.set()
    wait_until(lambda: "gone" in served.mesh.shards[0].released_ids())
    assert served.events("request_cancelled", "gone")[0]["by"] == "client"


def test_shutdown_ends_running_requests_and_the_server(model_files: ModelFiles) -> None:
    s = Served(model_files, shutdown_grace=0.2)
    s.publish()
    s.mesh.step_delay = 0.05  # 40 tokens take 2 s: longer than the grace
    stream = s.client.completions.create(model=None, prompt="hi", max_tokens=40, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].text  # running
    whole: dict[str, BaseException] = {}

    def ask() -> None:
        try:
            s.client.completions.create(model=None, prompt="hi", max_tokens=40, extra_headers={"X-Request-Id": "w"})
        except BaseException as e:
            whole["error"] = e

    asking = threading.Thread(target=ask)
    asking.start()
    wait_until(lambda: s.server.scheduler.load()[1] == 2)
    s.server.stop()
    asking.join(WAIT_S)
    # the stream ends with an error event (openai raises it), the whole answer with 503
    with pytest.raises(openai.APIError) as e:
        list(chunks)
    assert "shutting down" in e.value.message
    assert isinstance(whole["error"], openai.InternalServerError) and whole["error"].status_code == 503
    s.client.close()
    with pytest.raises(ConnectionRefusedError):  # the port is closed
        socket.create_connection(("127.0.0.1", s.server.http_port), timeout=WAIT_S).close()
    alive = [t.name for t in threading.enumerate() if t.name.startswith(("http-server", "http-request"))]
    assert not alive, alive


def test_gateway_http_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    def config(*flags: str) -> GatewayConfig:
        parser = argparse.ArgumentParser()
        app.add_arguments(parser)
        return app.build_config(parser.parse_args(["--coordinator", "c:1", *flags]))

    monkeypatch.delenv(app.API_KEY_ENV, raising=False)
    off = config()
    assert (off.http_listen, off.served_model_name, off.api_key) == (None, None, None)  # off unless asked for
    on = config("--http-listen", "0.0.0.0:8000", "--served-model-name", "chat", "--api-key", "k")
    assert (on.http_listen, on.served_model_name, on.api_key) == ("0.0.0.0:8000", "chat", "k")
    monkeypatch.setenv(app.API_KEY_ENV, "from-env")
    assert config().api_key == "from-env"
    with pytest.raises(UsageError, match="--http-listen: expected host:port"):
        config("--http-listen", "8000")
    with pytest.raises(UsageError, match="--served-model-name: must not be empty"):
        config("--served-model-name", " ")


def test_http_requests_are_traced_like_rpcs(model_files: ModelFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    """One request span per HTTP request, under the client's traceparent, named and described by OpenTelemetry's
    HTTP server conventions, with the GenAI attributes the gRPC path sets (the model as the HTTP API names it) and
    the same children (prepare, queue, steps)."""
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "_tracer", provider.get_tracer("test"))
    step = fakes._FutureMethod.future  # a real stub also takes the step's trace context as metadata
    monkeypatch.setattr(fakes._FutureMethod, "future", lambda self, request, timeout=None, metadata=None: step(
        self, request, timeout))  # fmt: skip
    s = Served(model_files, served_model_name="tiny-chat")
    try:
        s.publish()
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        s.client.chat.completions.create(model="tiny-chat", messages=HI, max_tokens=3, temperature=0.5,
                                         extra_headers={"X-Request-Id": "traced", "traceparent": parent})  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            s.client.chat.completions.create(model="tiny-chat", messages=HI, top_p=2,
                                             extra_headers={"X-Request-Id": "refused"})  # fmt: skip
        streamed = s.client.completions.create(model="tiny-chat", prompt="x", max_tokens=2, stream=True,
                                               extra_headers={"X-Request-Id": "streamed"})  # fmt: skip
        assert len([c for c in streamed if c.choices]) == 2
        s.server.scheduler.shutdown(grace=0.0)  # nothing serves any more: the next request fails, the server's fault
        with pytest.raises(openai.InternalServerError):
            s.client.completions.create(model="tiny-chat", prompt="x", max_tokens=1,
                                        extra_headers={"X-Request-Id": "unserved"})  # fmt: skip

        def span(request_id: str) -> Any:
            spans = [x for x in exporter.get_finished_spans() if x.kind is SpanKind.SERVER
                     and x.attributes.get("shardmesh.request_id") == request_id]  # fmt: skip
            return spans[0] if len(spans) == 1 else None

        wait_until(lambda: all(span(r) is not None for r in ("traced", "refused", "streamed", "unserved")))
        traced = span("traced")
        assert traced.name == "POST /v1/chat/completions" and traced.kind is SpanKind.SERVER
        assert f"{traced.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"  # joined the client's trace
        attributes = dict(traced.attributes)
        assert {k: v for k, v in attributes.items() if k.split(".")[0] in ("http", "url", "server", "network")} == {
            "http.request.method": "POST", "http.route": "/v1/chat/completions", "http.response.status_code": 200,
            "url.path": "/v1/chat/completions", "url.scheme": "http", "server.address": "127.0.0.1",
            "server.port": s.server.http_port, "network.protocol.version": "1.1",
        }  # fmt: skip
        assert attributes["client.address"] == "127.0.0.1" and attributes["user_agent.original"].startswith("OpenAI")
        assert not any(k.startswith("rpc.") for k in attributes)  # not an RPC
        assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny-chat"
        assert attributes["gen_ai.usage.output_tokens"] == 3 and attributes["gen_ai.request.temperature"] == 0.5
        assert traced.status.status_code is StatusCode.UNSET
        children = {x.name for x in exporter.get_finished_spans() if x.parent is not None
                    and x.parent.span_id == traced.context.span_id}  # fmt: skip
        assert {"prepare", "queue"} <= children
        # A refused request is the client's error: its status code and error.type, but no ERROR status.
        refused = span("refused")
        assert refused.name == "POST /v1/chat/completions" and refused.attributes["http.response.status_code"] == 400
        assert refused.attributes["error.type"] == "INVALID_ARGUMENT" and refused.status.status_code is StatusCode.UNSET
        assert span("streamed").name == "POST /v1/completions"
        assert span("streamed").attributes["gen_ai.operation.name"] == "text_completion"
        assert span("streamed").attributes["http.response.status_code"] == 200
        unserved = span("unserved")  # the server's failure: a 5xx and status ERROR
        assert unserved.attributes["http.response.status_code"] >= 500
        assert unserved.status.status_code is StatusCode.ERROR
    finally:
        s.close()
        provider.shutdown()
