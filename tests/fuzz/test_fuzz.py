"""Property-based fuzzing of every request the services take: random and malformed values in every field of every
gRPC method of the gateway, the workers and the coordinator, and random bodies for the OpenAI-compatible HTTP API.

Against real processes on 127.0.0.1: a `shardmesh up` mesh (one worker, a tiny random checkpoint with a byte-level
tokenizer and a chat template) for the gateway (gRPC and HTTP) and its worker, and a coordinator of its own (fuzzing
registrations and drains there cannot disturb the mesh). Every answer must be a deliberate one: a refusal that names
what is wrong (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED; 4xx over HTTP) or an answer,
never INTERNAL or UNKNOWN (a bug), never a 5xx, never a call that outlives its deadline, and never a process that
dies. After each method's examples, a correct request is served as before (the same tokens as before any fuzzing).

Examples are few (each is a round trip to a real process) and derandomized, so runs are repeatable; the whole file
takes under a minute on 2 cores.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardmesh.proto.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    gateway_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.checkpoints import make_checkpoint
from tests.fuzz.strategies import TEXT, bodies, messages
from tests.meshes import Mesh
from tests.stack import Stack
from tests.unit.gateway.fakes import VOCAB, write_tokenizer

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
DEADLINE_S = 20.0  # far above any answer here (milliseconds): only a hang reaches it
# A status that is never a deliberate answer: a bug (INTERNAL, UNKNOWN), a hang (DEADLINE_EXCEEDED), a process
# that died or stopped answering (UNAVAILABLE: nothing here is shutting down or losing a worker).
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}  # fmt: skip
REFERENCE = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[1, 17, 5, 42]),
                                        params=gateway_pb2.SamplingParams(max_new_tokens=8))  # fmt: skip
PROBE = [1, 17, 5, 42]


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    """The status `call` ends with; a deliberate one, or the test fails naming it."""
    try:
        call()
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    assert code not in NEVER, f"{code.name}: {details}"
    return code


# -- the processes ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz") / "tiny-chat"
    make_checkpoint(directory, "llama-gqa-tied", num_layers=2, seed=3, vocab_size=VOCAB, eos_token_id=VOCAB - 1)
    return write_tokenizer(directory)


class Served:
    """`up` with one worker: its gateway (gRPC and HTTP), and the answer to REFERENCE before any fuzzing."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.http = mesh, mesh.http_url()
        self.reference = list(self.generate().token_ids)

    def generate(self) -> gateway_pb2.GenerateResponse:
        return self.mesh.stub.Generate(REFERENCE, timeout=DEADLINE_S)

    def still_serves(self) -> None:
        """Every process of the mesh runs, and REFERENCE gets the tokens it got before."""
        assert self.mesh.proc.poll() is None, "up exited"
        assert list(self.generate().token_ids) == self.reference


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    mesh = Mesh(model, 1, 1, tmp_path_factory.mktemp("fuzz-up"))
    try:
        yield Served(mesh)
    finally:
        mesh.close()


class Services:
    """A coordinator and one worker started one by one (as compose would), the worker's stub, and the token its
    first step draws for PROBE before any fuzzing. Steps from anyone but the gateway take turns with the gateway's
    own (by `after_step_id`), so this worker serves no gateway: what a stranger's steps do to a serving mesh is
    what mutual TLS on the workers' port prevents."""

    def __init__(self, stack: Stack, model: Path) -> None:
        self.stack = stack
        self.coordinator = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(
            stack.start_coordinator(model, 1, 1)))  # fmt: skip
        stack.start_worker("w-real")
        topology = stack.wait_complete()
        self.version = topology.version
        address = topology.stages[0].shards[0].address
        self.worker = worker_pb2_grpc.StageWorkerStub(grpc.insecure_channel(address))
        self.reference = self.probe()

    def probe(self) -> int:
        """One greedy step over PROBE's prompt in slot 0, then its release; the token it drew."""
        entry = worker_pb2.BatchEntry(request_id="probe", slot=0, start_pos=0, num_tokens=len(PROBE), token_ids=PROBE,
                                      sampling=worker_pb2.TokenSampling(top_p=1.0, repetition_penalty=1.0))  # fmt: skip
        step = worker_pb2.StepRequest(step_id=1, topology_version=self.version, entries=[entry])
        (token,) = self.worker.Step(step, timeout=DEADLINE_S).tokens
        self.worker.Release(worker_pb2.ReleaseRequest(sequences=[worker_pb2.ReleasedSequence(request_id="probe")]),
                            timeout=DEADLINE_S)  # fmt: skip
        return token.token_id

    def alive(self) -> None:
        for name, p in self.stack.procs.items():
            assert p.poll() is None, f"{name} exited"


@pytest.fixture(scope="module")
def services(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    stack = Stack(tmp_path_factory.mktemp("fuzz-services"))
    try:
        yield Services(stack, model)
    finally:
        stack.close()


# -- the gateway ----------------------------------------------------------------------------------------------------


def _sampling(max_new: st.SearchStrategy[int]) -> st.SearchStrategy[gateway_pb2.SamplingParams]:
    return messages(gateway_pb2.SamplingParams.DESCRIPTOR, max_new_tokens=max_new)


ROLES = st.sampled_from(["user", "system", "assistant", "", "tool"]) | TEXT
# Random in every field; or close to right (token ids in the vocabulary, chats with real roles, short answers),
# which gets past the first checks to the tokenizer, the template, the scheduler and the sampler.
GENERATE = messages(gateway_pb2.GenerateRequest.DESCRIPTOR) | st.builds(
    lambda prompt, params, request_id: gateway_pb2.GenerateRequest(**prompt, params=params, request_id=request_id),
    st.one_of(
        st.builds(lambda t: {"prompt": t}, TEXT),
        st.builds(lambda ids: {"token_ids": gateway_pb2.TokenIds(ids=ids)}, st.lists(st.integers(0, VOCAB),
                                                                                      max_size=300)),
        st.builds(lambda turns: {"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c)
                                                                            for r, c in turns])},
                  st.lists(st.tuples(ROLES, TEXT), max_size=4)),
    ),
    _sampling(st.integers(0, 6) | st.integers(0, 2**32 - 1)) | st.none(),
    st.none() | st.text(max_size=20) | TEXT,
)  # fmt: skip


@settings(FUZZ, max_examples=100)
@given(request=GENERATE, streamed=st.booleans())
def test_gateway_generate(served: Served, request: gateway_pb2.GenerateRequest, streamed: bool) -> None:
    stub = served.mesh.stub
    if streamed:
        _code(lambda: list(stub.GenerateStream(request, timeout=DEADLINE_S)))
    else:
        _code(lambda: stub.Generate(request, timeout=DEADLINE_S))


def test_gateway_serves_after_the_fuzz_and_answers_model_info(served: Served) -> None:
    info = served.mesh.stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=DEADLINE_S)
    assert info.ready and info.max_context == 256
    served.still_serves()


# -- the HTTP API ---------------------------------------------------------------------------------------------------


def _http(url: str, body: bytes | None = None, content_type: str = "application/json",
          request_id: str | None = None) -> tuple[int, bytes]:  # fmt: skip
    headers = {"Content-Type": content_type} if body is not None else {}
    if request_id is not None:
        headers["X-Request-Id"] = request_id
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _check_http(status: int, payload: bytes, streamed: bool) -> None:
    """Below 500; an error in OpenAI's shape; a stream (when one was asked for and the request accepted) of JSON
    events ending in [DONE], none of them an internal error."""
    assert status < 500, payload[:500]
    if status == 200 and streamed:
        events = [line.removeprefix(b"data: ") for line in payload.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]", events[-3:]
        for event in events[:-1]:
            error = json.loads(event).get("error")
            assert error is None or error["code"] != "internal_error", error
        return
    document = json.loads(payload)
    if status >= 400:
        assert set(document["error"]) >= {"message", "type", "param", "code"}, document


# What an HTTP header can carry (urllib sends Latin-1), printable or not, and longer than the gateway takes.
HEADER_VALUES = st.none() | st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                                    max_size=200)  # fmt: skip


@settings(FUZZ, max_examples=100)
@given(kind=st.sampled_from(["chat", "text"]), body=st.data(), request_id=HEADER_VALUES)
def test_http_completions(served: Served, kind: str, body: st.DataObject, request_id: str | None) -> None:
    sent = body.draw(bodies(kind) | st.binary(max_size=100), label="body")
    raw = sent if isinstance(sent, bytes) else json.dumps(sent).encode()
    path = "/chat/completions" if kind == "chat" else "/completions"
    status, payload = _http(served.http + path, raw, request_id=request_id)
    _check_http(status, payload, streamed=isinstance(sent, dict) and sent.get("stream") is True)


@FUZZ
@given(name=TEXT, content_type=st.sampled_from(["application/json", "text/plain", ""]), body=st.binary(max_size=50))
def test_http_models_and_odd_requests(served: Served, name: str, content_type: str, body: bytes) -> None:
    quoted = urllib.request.quote(name, safe="")
    for url in (f"{served.http}/models", f"{served.http}/models/{quoted}"):
        status, payload = _http(url)
        assert status in (200, 404), payload[:300]
        _check_http(status, payload, streamed=False)
    status, payload = _http(f"{served.http}/chat/completions", body, content_type)
    _check_http(status, payload, streamed=False)


def test_http_serves_after_the_fuzz(served: Served) -> None:
    body = {"prompt": [1, 17, 5, 42], "max_tokens": 8, "temperature": 0, "return_tokens_as_token_ids": True,
            "logprobs": 0}  # fmt: skip
    status, payload = _http(served.http + "/completions", json.dumps(body).encode())
    assert status == 200, payload
    tokens = json.loads(payload)["choices"][0]["logprobs"]["tokens"]
    assert [int(t.removeprefix("token_id:")) for t in tokens] == served.reference
    served.still_serves()


# -- the worker -----------------------------------------------------------------------------------------------------


def _steps(version: int) -> st.SearchStrategy[worker_pb2.StepRequest]:
    """Steps of the current topology whose entries are random or nearly valid (slots, positions and token ids in
    range, any sampling): those run on the model. `after_step_id` is 0: a step that names another one waits for it
    by design (up to the worker's arrival timeout), which `test_worker_waits_for_a_missing_step_as_long_as_asked`
    covers."""
    entry = messages(worker_pb2.BatchEntry.DESCRIPTOR) | st.builds(
        lambda slot, ids, start, sampling, skip: worker_pb2.BatchEntry(
            request_id="fuzz", slot=slot, start_pos=start, num_tokens=len(ids), token_ids=ids, sampling=sampling,
            skip_sampling=skip),
        st.integers(0, 9), st.lists(st.integers(0, VOCAB), max_size=20), st.integers(0, 260),
        messages(worker_pb2.TokenSampling.DESCRIPTOR), st.booleans(),
    )  # fmt: skip
    return st.builds(lambda v, step_id, entries: worker_pb2.StepRequest(step_id=step_id, topology_version=v,
                                                                        entries=entries),
                     _version(version), st.integers(1, 2**64 - 1), st.lists(entry, max_size=4))  # fmt: skip


def _version(current: int) -> st.SearchStrategy[int]:
    return st.just(current) | st.integers(0, 2**64 - 1)


def _calibrations(version: int) -> st.SearchStrategy[worker_pb2.CalibrateRequest]:
    """Random, or passes of at most 64 tokens a few times: the valid ones run, briefly."""
    small = {"decode_batch": st.integers(0, 9), "prefill_tokens": st.integers(0, 64), "iterations": st.integers(0, 3)}
    return messages(worker_pb2.CalibrateRequest.DESCRIPTOR, topology_version=_version(version)) | messages(
        worker_pb2.CalibrateRequest.DESCRIPTOR, topology_version=_version(version), **small)  # fmt: skip


@FUZZ
@given(data=st.data())
def test_worker_rpcs(services: Services, data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(["Step", "Release", "GetShardInfo", "Calibrate"]), label="method")
    if method == "Step":
        random = messages(worker_pb2.StepRequest.DESCRIPTOR, after_step_id=0)
        request = data.draw(_steps(services.version) | random, label="request")
    elif method == "Calibrate":
        request = data.draw(_calibrations(services.version), label="request")
    else:
        request = data.draw(messages(getattr(worker_pb2, f"{method}Request").DESCRIPTOR), label="request")
    _code(lambda: getattr(services.worker, method)(request, timeout=DEADLINE_S))


def test_worker_waits_for_a_missing_step_as_long_as_asked(services: Services) -> None:
    """A step after one that never comes waits for it (the worker keeps the gateway's order), until its caller
    gives up."""
    entry = worker_pb2.BatchEntry(request_id="orphan", slot=0, num_tokens=1, token_ids=[5], skip_sampling=True)
    step = worker_pb2.StepRequest(step_id=777, topology_version=services.version, entries=[entry], after_step_id=776)
    with pytest.raises(grpc.RpcError) as e:
        services.worker.Step(step, timeout=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_worker_serves_after_the_fuzz(services: Services) -> None:
    services.alive()
    info = services.worker.GetShardInfo(worker_pb2.GetShardInfoRequest(), timeout=DEADLINE_S)
    assert info.state == common_pb2.SHARD_STATE_READY
    assert services.probe() == services.reference


# -- the coordinator (after the worker's tests: registrations that claim its shard may take it over) ----------------

WORKER_IDS = st.sampled_from(["fuzz-0", "fuzz-1", "x"]) | TEXT
ADDRESSES = st.sampled_from(["127.0.0.1:1", "[::1]:2", "localhost:0", "a:b", ""]) | TEXT
COORDINATOR_REQUESTS = {
    "Register": messages(coordinator_pb2.RegisterRequest.DESCRIPTOR, address=ADDRESSES, worker_id=WORKER_IDS),
    "Heartbeat": messages(coordinator_pb2.HeartbeatRequest.DESCRIPTOR, worker_id=WORKER_IDS),
    "Deregister": messages(coordinator_pb2.DeregisterRequest.DESCRIPTOR, worker_id=WORKER_IDS),
    "GetTopology": messages(coordinator_pb2.GetTopologyRequest.DESCRIPTOR),
    "ReportFailure": messages(coordinator_pb2.ReportFailureRequest.DESCRIPTOR, worker_ids=st.lists(WORKER_IDS)),
    "Drain": messages(coordinator_pb2.DrainRequest.DESCRIPTOR, worker_id=WORKER_IDS),
}


@FUZZ
@given(data=st.data())
def test_coordinator_rpcs(services: Services, data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(list(COORDINATOR_REQUESTS)), label="method")
    request = data.draw(COORDINATOR_REQUESTS[method], label="request")
    _code(lambda: getattr(services.coordinator, method)(request, timeout=DEADLINE_S))


@settings(FUZZ, max_examples=6)
@given(after=st.integers(0, 3) | st.integers(0, 2**64 - 1))
def test_coordinator_watch(services: Services, after: int) -> None:
    """A watch sends a topology newer than `after_version` (or the current one, when `after_version` is beyond it:
    it came from an earlier coordinator), and waits while there is none (by design): it ends with a topology, or
    at its deadline, never otherwise."""
    stream = services.coordinator.WatchTopology(coordinator_pb2.WatchTopologyRequest(after_version=after), timeout=0.5)
    try:
        assert next(stream).version != after
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    finally:
        stream.cancel()


def test_coordinator_serves_after_the_fuzz(services: Services) -> None:
    services.alive()
    stub = services.coordinator
    device = common_pb2.Device(type=common_pb2.DEVICE_TYPE_CPU, name="cpu", memory_bytes=2**33)
    registered = stub.Register(coordinator_pb2.RegisterRequest(address="127.0.0.1:9", device=device,
                                                               worker_id="after-fuzz"), timeout=DEADLINE_S)  # fmt: skip
    assert registered.worker_id == "after-fuzz"
    beat = coordinator_pb2.HeartbeatRequest(worker_id="after-fuzz", state=common_pb2.SHARD_STATE_PENDING)
    assert stub.Heartbeat(beat, timeout=DEADLINE_S).known
    stub.Deregister(coordinator_pb2.DeregisterRequest(worker_id="after-fuzz"), timeout=DEADLINE_S)
    assert "after-fuzz" not in {w.worker_id for w in stub.GetTopology(coordinator_pb2.GetTopologyRequest(),
                                                                        timeout=DEADLINE_S).workers}  # fmt: skip
