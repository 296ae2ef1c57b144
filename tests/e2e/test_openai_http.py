"""The OpenAI-compatible HTTP API of a real mesh (`shardmesh up`, one stage worker, a tiny random checkpoint with a
byte-level tokenizer and a chat template), driven by the official `openai` client and by raw HTTP.

Every answer is compared with the same request sent through the gRPC API of the same gateway: the two front doors
share the scheduler, so greedy and seeded answers must be the same tokens, text and finish reason, penalties and
top-n logprobs included. Greedy decoding with a repetition penalty is compared with `transformers`' `generate`. One
mesh serves the whole module.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from shardmesh.models.tokenizer import Tokenizer
from shardmesh.proto.v1 import common_pb2, gateway_pb2
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.meshes import Mesh
from tests.unit.gateway.fakes import VOCAB, write_tokenizer
from tests.waiting import wait_until

EOS = VOCAB - 1  # "<|im_end|>" of the byte-level tokenizer
FINISH = {common_pb2.FINISH_REASON_EOS: "stop", common_pb2.FINISH_REASON_STOP_STRING: "stop",
          common_pb2.FINISH_REASON_STOP_TOKEN: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}  # fmt: skip
HELLO = [{"role": "user", "content": "Hello there, who are you?"}]
# Room for a request that cannot end before its client's departure is seen: this model decodes a token in well under a
# millisecond, so 200 tokens could end first on a busy machine (a fresh-clone run once found no cancellation).
CONTEXT = 4096
LONG = CONTEXT - 64


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("openai") / "tiny-chat"
    # Untied embeddings: a tied random model's greedy answer repeats one token; this one's varies (9 distinct tokens
    # in HELLO's first 30), so comparing answers token for token compares something.
    make_checkpoint(directory, "llama-mha-untied", num_layers=2, seed=1, vocab_size=VOCAB, eos_token_id=EOS,
                    max_position_embeddings=CONTEXT)  # fmt: skip
    return write_tokenizer(directory)


@pytest.fixture(scope="module")
def mesh(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = Mesh(model, 1, 1, tmp_path_factory.mktemp("openai-up"), "--max-context", str(CONTEXT))
    try:
        yield m
    finally:
        m.close()


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> Iterator[openai.OpenAI]:
    # No key is configured on this gateway: whatever the client sends is accepted.
    with openai.OpenAI(base_url=mesh.http_url(), api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def name(model: Path) -> str:
    """The model id: `up` names it by its --model, as given."""
    return str(model)


def _grpc(mesh: Mesh, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
    return mesh.stub.Generate(request, timeout=60)


def _ids(tokens: list[str]) -> list[int]:
    """Token ids from logprob tokens shown as `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _gateway_events(mesh: Mesh, name: str, request_id: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in mesh.log("gateway").splitlines() if line.startswith("{")]
    return [e for e in lines if e.get("event") == name and e.get("request_id") == request_id]


def test_health_and_models_name_the_model_as_given(mesh: Mesh, client: openai.OpenAI, model: Path) -> None:
    root = mesh.http_url().removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/health", timeout=10) as response:
        assert response.status == 200
    assert [m.id for m in client.models.list()] == [str(model)]  # up's --model, as given
    assert client.models.retrieve(str(model)).id == str(model)


def test_chat_matches_grpc_and_transformers(mesh: Mesh, client: openai.OpenAI, name: str, model: Path) -> None:
    answer = client.chat.completions.create(
        model=name, messages=HELLO, max_tokens=24, temperature=0,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in HELLO])
    reference = _grpc(mesh, gateway_pb2.GenerateRequest(chat=chat, params=gateway_pb2.SamplingParams(
        max_new_tokens=24, temperature=0.0)))  # fmt: skip
    choice = answer.choices[0]
    assert _ids([t.token for t in choice.logprobs.content]) == list(reference.token_ids)
    # and both are transformers' greedy answer to the chat template's prompt
    prompt_ids = Tokenizer.from_dir(model).encode_chat(HELLO)
    assert list(reference.token_ids) == reference_greedy(model, prompt_ids, len(reference.token_ids))[0]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(reference.logprobs), abs=1e-6)
    assert choice.message.content == reference.text and choice.message.role == "assistant"
    assert choice.finish_reason == FINISH[reference.finish_reason]
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        reference.usage.prompt_tokens, reference.usage.completion_tokens)  # fmt: skip
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")


def test_streamed_seeded_completion_matches_grpc(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    prompt = [1, 17, 5, 42, 33, 8]
    stream = client.completions.create(
        model=name, prompt=prompt, max_tokens=20, temperature=0.8, top_p=0.9, seed=7,
        stream=True, stream_options={"include_usage": True}, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    chunks = list(stream)
    params = gateway_pb2.SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    reference = _grpc(mesh, gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), params=params))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
    assert _ids(tokens) == list(reference.token_ids)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == FINISH[reference.finish_reason] and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt)


def test_stop_strings_end_the_answer_as_on_grpc(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    prompt = "Once upon a time"
    params = gateway_pb2.SamplingParams(max_new_tokens=40, temperature=0.0)
    full = _grpc(mesh, gateway_pb2.GenerateRequest(prompt=prompt, params=params)).text
    # a character that first appears past the answer's start (not U+FFFD, which stands for partial bytes)
    stop = next((c for c in full if c != "\ufffd" and full.index(c) >= 2), None)
    assert stop is not None, f"no character to stop at in {full!r}"
    params.stop.append(stop)
    reference = _grpc(mesh, gateway_pb2.GenerateRequest(prompt=prompt, params=params))
    answer = client.completions.create(model=name, prompt=prompt, max_tokens=40,
                                       temperature=0, stop=[stop])  # fmt: skip
    assert answer.choices[0].text == reference.text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop" == FINISH[reference.finish_reason]
    assert reference.finish_reason == common_pb2.FINISH_REASON_STOP_STRING


PENALTIES = {"frequency_penalty": 0.75, "presence_penalty": 0.5, "repetition_penalty": 1.25, "min_p": 0.05}


def test_penalties_and_top_logprobs_match_grpc(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    """vLLM's sampling fields over HTTP are the gRPC fields: the same tokens, logprobs and alternatives."""
    answer = client.chat.completions.create(
        model=name, messages=HELLO, max_tokens=16, temperature=0.7, seed=3, logprobs=True, top_logprobs=4,
        frequency_penalty=PENALTIES["frequency_penalty"], presence_penalty=PENALTIES["presence_penalty"],
        extra_body={"repetition_penalty": PENALTIES["repetition_penalty"], "min_p": PENALTIES["min_p"],
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(**m) for m in HELLO])
    params = gateway_pb2.SamplingParams(max_new_tokens=16, temperature=0.7, seed=3, top_logprobs=4, **PENALTIES)
    reference = _grpc(mesh, gateway_pb2.GenerateRequest(chat=chat, params=params))
    content = answer.choices[0].logprobs.content
    assert _ids([t.token for t in content]) == list(reference.token_ids)
    assert [t.logprob for t in content] == pytest.approx(list(reference.logprobs), abs=1e-6)
    assert [_ids([a.token for a in t.top_logprobs]) for t in content] == [
        [a.token_id for a in top.alternatives] for top in reference.top_logprobs]  # fmt: skip
    assert [[a.logprob for a in t.top_logprobs] for t in content] == [
        pytest.approx([a.logprob for a in top.alternatives], abs=1e-6) for top in reference.top_logprobs]  # fmt: skip
    assert all(len(t.top_logprobs) == 4 for t in content)
    assert answer.choices[0].message.content == reference.text
    # Streamed completions, greedy: `logprobs: 3` maps the 3 alternatives and the sampled token.
    prompt = [1, 17, 5, 42, 33, 8]
    stream = client.completions.create(
        model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True, logprobs=3,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.5, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    logprobs = [c.choices[0].logprobs for c in stream if c.choices]
    params = gateway_pb2.SamplingParams(max_new_tokens=12, frequency_penalty=0.5, repetition_penalty=1.5,
                                        top_logprobs=3)  # fmt: skip
    reference = _grpc(mesh, gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), params=params))
    assert _ids([t for lp in logprobs for t in lp.tokens]) == list(reference.token_ids)
    tops = [d for lp in logprobs for d in lp.top_logprobs]
    for top, token, alternatives in zip(tops, reference.token_ids, reference.top_logprobs, strict=True):
        assert set(_ids(list(top))) == {token, *(a.token_id for a in alternatives.alternatives)}


def test_greedy_with_a_repetition_penalty_matches_transformers_generate(mesh: Mesh, model: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = [1, 17, 5, 42, 33, 8]
    params = gateway_pb2.SamplingParams(max_new_tokens=24, temperature=0.0, repetition_penalty=1.3)
    got = _grpc(mesh, gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), params=params))
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, repetition_penalty=1.3, max_new_tokens=24,
                          pad_token_id=EOS)  # fmt: skip
    expected = out[0, len(prompt) :].tolist()
    assert list(got.token_ids) == expected
    # The penalty matters here: without it the answer is another one.
    assert expected != reference_greedy(model, prompt, len(expected))[0]


def test_server_sent_events_framing(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    body = {"messages": HELLO, "max_tokens": 12, "temperature": 0, "stream": True}
    status, raw = _post(f"{mesh.http_url()}/chat/completions", body)
    assert status == 200
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    whole = client.chat.completions.create(model=name, messages=HELLO, max_tokens=12,
                                           temperature=0)  # fmt: skip
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason


def test_errors_by_status_code(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"top_p": 1.5}, "top_p"), ({"n": 2}, "n"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"max_tokens": 100_000}, "max_tokens"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"stop_token_ids": [1, 10_000]}}, "stop_token_ids[1]"),
    ]  # fmt: skip
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=HELLO, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kwargs, e.value.body)
        assert e.value.body["message"].startswith(f"{param}: "), e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    # A malformed body is a 400 naming the field (not FastAPI's 422); unknown fields are ignored.
    status, raw = _post(f"{mesh.http_url()}/chat/completions", {"messages": HELLO, "temperature": "hot"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "temperature"
    status, raw = _post(f"{mesh.http_url()}/completions", {"prompt": [1, 2], "max_tokens": 2, "no_such_field": 1})
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")


def test_closing_the_stream_cancels_the_request(mesh: Mesh, client: openai.OpenAI, name: str) -> None:
    """The chat stream's first chunk (the role) comes before any token; the client leaves right after it, and the
    scheduler cancels the request long before its ~4000 tokens (the end of sequence ignored)."""
    stream = client.chat.completions.create(model=name, messages=HELLO, max_tokens=LONG, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            extra_headers={"X-Request-Id": "http-stream-gone"})  # fmt: skip
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    stream.close()
    wait_until(lambda: bool(_gateway_events(mesh, "request_cancelled", "http-stream-gone")), timeout=60)
    cancelled = _gateway_events(mesh, "request_cancelled", "http-stream-gone")[0]
    assert cancelled["by"] == "client" and cancelled["completion_tokens"] < LONG


def test_a_client_that_disconnects_cancels_a_whole_answer(mesh: Mesh) -> None:
    host, port = mesh.http_url().removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    body = json.dumps({"messages": HELLO, "max_tokens": 200, "temperature": 0}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: http-unary-gone\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + body)  # and leave without reading the answer
    wait_until(lambda: bool(_gateway_events(mesh, "request_cancelled", "http-unary-gone")), timeout=60)
    assert _gateway_events(mesh, "request_cancelled", "http-unary-gone")[0]["by"] == "client"
