"""The OpenAI-compatible API without a server: request bodies mapped onto the gateway's own `GenerateCall` (the
gRPC servicer's), refusals naming the OpenAI field, the error shape and statuses, and responses rendered from
scheduler events."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gateway.openai_api import invalid_body
from gateway.openai_errors import ModelNotFound, NotSupportedYet, Unauthorized, error_body
from gateway.openai_render import Answer
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, ResponseOptions, openai_field
from gateway.requests import ChatTurn, GenerateParams, ModelContext, Sampling, prepare
from gateway.results import FinishReason, Summary, Timings, TokenEvent
from gateway.watcher import ModelFiles
from shardmesh.core.errors import Cancelled, Internal, InvalidArgument, MeshError, ResourceExhausted, Unavailable
from shardmesh.proto.v1 import gateway_pb2
from tests.unit.gateway.fakes import VOCAB, ids_of

HI = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": HI, **fields})


def _refusal(make: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        make()
    return e.value


def _context(files: ModelFiles, max_context: int = 48) -> ModelContext:
    return ModelContext(VOCAB, max_context, files.tokenizer, files.eos_token_ids, default_max_new_tokens=8)


def test_chat_maps_onto_the_grpc_call_with_openai_defaults() -> None:
    body = _chat(model="m", max_tokens=5, stop="\n", seed=3, user="u1", unknown_field={"ignored": True})
    call = body.generate_call("r1")
    assert (call.request_id, call.input.kind, call.input.chat) == ("r1", "chat", (ChatTurn("user", "hi"),))
    assert call.params.max_new_tokens == 5 and call.params.stop == ("\n",)
    # OpenAI's defaults (temperature 1, top_p 1), not the gRPC API's greedy
    assert call.params.sampling == Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=3)
    # max_completion_tokens wins over max_tokens; vLLM's top_k -1 means no limit; text parts are joined
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = ChatCompletionRequest.model_validate({
        "messages": [{"role": "system", "content": None}, {"role": "user", "content": parts}],
        "max_tokens": 5, "max_completion_tokens": 7, "top_k": -1, "temperature": 0, "stop": ["x", "y"],
    }).generate_call("r2")  # fmt: skip
    assert call.input.chat == (ChatTurn("system", ""), ChatTurn("user", "a\nb"))
    assert (call.params.max_new_tokens, call.params.sampling.top_k, call.params.stop) == (7, 0, ("x", "y"))
    # left out: the gateway's default length (0 here, resolved by `prepare`)
    assert _chat().generate_call("r3").params.max_new_tokens == 0


def test_completion_prompts_as_text_or_token_ids() -> None:
    text = CompletionRequest.model_validate({"prompt": "Once"}).generate_call("a").input
    assert (text.kind, text.text) == ("prompt", "Once")
    ids = CompletionRequest.model_validate({"prompt": [1, 2, 3]}).generate_call("b").input
    assert (ids.kind, ids.token_ids) == ("token_ids", (1, 2, 3))
    single = CompletionRequest.model_validate({"prompt": [[4, 5]]}).generate_call("c").input
    assert single.token_ids == (4, 5)
    batch = _refusal(lambda: CompletionRequest.model_validate({"prompt": ["a", "b"]}).generate_call("d"))
    assert isinstance(batch, NotSupportedYet) and batch.field_name == "prompt"
    assert _refusal(lambda: CompletionRequest.model_validate({"prompt": ""}).generate_call("e")).field_name == "prompt"


@pytest.mark.parametrize(
    ("fields", "param", "not_yet"),
    [
        ({"top_p": 1.5}, "top_p", False), ({"temperature": -1}, "temperature", False), ({"top_k": -2}, "top_k", False),
        ({"max_tokens": 0}, "max_tokens", False), ({"max_completion_tokens": 0}, "max_completion_tokens", False),
        ({"seed": -1}, "seed", False), ({"seed": 2**64}, "seed", False), ({"stop": ""}, "stop", False),
        ({"stop": ["a", ""]}, "stop[1]", False), ({"stop": ["s"] * 17}, "stop", False), ({"n": 0}, "n", False),
        ({"n": 2}, "n", True), ({"frequency_penalty": 3}, "frequency_penalty", False),
        ({"presence_penalty": -2.5}, "presence_penalty", False),
        ({"repetition_penalty": 0}, "repetition_penalty", False),
        ({"min_p": 1.5}, "min_p", False), ({"min_p": -0.1}, "min_p", False),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", True), ({"stop_token_ids": [1] * 257}, "stop_token_ids", False),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", False),
        ({"top_logprobs": 2}, "top_logprobs", False),  # without logprobs: true, as OpenAI and vLLM refuse it
        ({"tools": [{"type": "function"}]}, "tools", True), ({"tool_choice": "required"}, "tool_choice", True),
        ({"response_format": {"type": "json_object"}}, "response_format", True),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type", True),
        ({"messages": [{"role": "assistant", "tool_calls": [{}]}]}, "messages[0].tool_calls", True),
    ],
)  # fmt: skip
def test_chat_refusals_name_the_openai_field(fields: dict[str, Any], param: str, not_yet: bool) -> None:
    e = _refusal(lambda: _chat(**fields).generate_call("r"))
    assert e.field_name == param and str(e).startswith(f"{param}: "), str(e)
    assert isinstance(e, NotSupportedYet) == not_yet, str(e)
    if not_yet:
        assert "not supported yet" in str(e)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"echo": True}, "echo"),
     ({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"), ({"frequency_penalty": -2.01}, "frequency_penalty")],
)  # fmt: skip
def test_completion_refusals_name_the_openai_field(fields: dict[str, Any], param: str) -> None:
    e = _refusal(lambda: CompletionRequest.model_validate({"prompt": "x", **fields}).generate_call("r"))
    assert e.field_name == param and str(e).startswith(f"{param}: ")


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    neutral = {"n": 1, "logit_bias": {}, "logprobs": True, "top_logprobs": 0, "tools": [], "tool_choice": "none",
               "response_format": {"type": "text"}}  # fmt: skip
    assert _chat(**neutral).generate_call("r").params.max_new_tokens == 0
    completion = CompletionRequest.model_validate({"prompt": "x", "logprobs": 0, "echo": False, "best_of": 1})
    assert completion.generate_call("r").input.text == "x" and completion.options().logprobs


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_penalties_and_stopping_map_onto_the_grpc_params(kind: str) -> None:
    """vLLM's sampling fields become the very `GenerateParams` the gRPC servicer builds from the same values."""
    fields = {"temperature": 0.5, "top_p": 0.75, "seed": 9, "max_tokens": 6, "frequency_penalty": 0.5,
              "presence_penalty": -0.25, "repetition_penalty": 1.25, "min_p": 0.125, "ignore_eos": True,
              "stop_token_ids": [7, 11]}  # fmt: skip
    if kind == "chat":
        params = _chat(**fields, logprobs=True, top_logprobs=3).generate_call("r").params
    else:
        params = CompletionRequest.model_validate({"prompt": "x", **fields, "logprobs": 3}).generate_call("r").params
    pb = gateway_pb2.SamplingParams(max_new_tokens=6, temperature=0.5, top_p=0.75, seed=9, frequency_penalty=0.5,
                                    presence_penalty=-0.25, repetition_penalty=1.25, min_p=0.125, ignore_eos=True,
                                    stop_token_ids=[7, 11], top_logprobs=3)  # fmt: skip
    assert params == GenerateParams.of_request(gateway_pb2.GenerateRequest(prompt="x", params=pb))
    assert params.sampling.top_logprobs == 3 and params.stop_token_ids == (7, 11) and params.ignore_eos
    # logprobs without top_logprobs (chat), or logprobs: 0 (completions): the sampled token's only
    assert _chat(logprobs=True).generate_call("r").params.sampling.top_logprobs == 0
    assert CompletionRequest.model_validate({"prompt": "x", "logprobs": 0}).generate_call("r").params.sampling == (
        Sampling(temperature=1.0))  # fmt: skip


def test_response_options() -> None:
    assert _chat(stream=True, stream_options={"include_usage": True}, logprobs=True,
                 return_tokens_as_token_ids=True).options() == ResponseOptions(True, True, True, True)  # fmt: skip
    assert _chat().options() == ResponseOptions(False, False, False, False)
    assert _refusal(lambda: _chat(stream_options={"include_usage": True}).options()).field_name == "stream_options"


def test_prepare_refusals_are_renamed_too(model_files: ModelFiles) -> None:
    """The shared `prepare` names gRPC fields; through `openai_names` the client reads its own."""

    def prepared(body: ChatCompletionRequest | CompletionRequest) -> Any:
        with body.openai_names():
            return prepare(body.generate_call("r"), _context(model_files), 0.0)

    e = _refusal(lambda: prepared(CompletionRequest.model_validate({"prompt": [1, 2, VOCAB + 5]})))
    assert str(e) == f"prompt[2]: token id {VOCAB + 5} is outside the vocabulary [0, {VOCAB})"
    e = _refusal(lambda: prepared(_chat(max_completion_tokens=40)))
    assert e.field_name == "max_completion_tokens" and "+ max_completion_tokens (40) exceeds the context" in str(e)
    e = _refusal(lambda: prepared(CompletionRequest.model_validate({"prompt": "x" * 60})))
    assert e.field_name == "prompt" and "do not fit the context of 48 tokens" in str(e)
    e = _refusal(lambda: prepared(_chat(stop_token_ids=[3, VOCAB])))
    assert str(e) == f"stop_token_ids[1]: token id {VOCAB} is outside the vocabulary [0, {VOCAB})"
    ok = prepared(_chat(max_tokens=3))
    assert ok.prompt_ids == tuple(model_files.tokenizer.encode_chat(HI)) and ok.max_new_tokens == 3
    assert prepared(_chat()).max_new_tokens == 8  # the gateway's default


def test_openai_field_names() -> None:
    assert openai_field("params.top_p") == "top_p"
    assert openai_field("params.max_new_tokens", "max_completion_tokens") == "max_completion_tokens"
    assert openai_field("params.stop[2]") == "stop[2]" and openai_field("params.stop[0]", single_stop=True) == "stop"
    assert openai_field("chat.messages[3].role") == "messages[3].role" and openai_field("chat") == "messages"
    assert openai_field("token_ids.ids[4]") == "prompt[4]" and openai_field("prompt") == "prompt"


def test_malformed_bodies_name_the_field() -> None:
    def errors(body: Any, model: type = ChatCompletionRequest) -> list[dict[str, Any]]:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        return [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]  # as FastAPI reports them

    e = invalid_body(errors({"messages": HI, "temperature": "hot"}))
    assert e.field_name == "temperature" and str(e).startswith("temperature: input should be a valid number")
    e = invalid_body(errors({"messages": HI, "stop": 5}))
    assert e.field_name == "stop" and "valid string or input should be a valid list" in str(e)
    assert invalid_body(errors({"messages": [{"content": "x"}]})).field_name == "messages[0].role"
    assert str(invalid_body(errors({}))) == "messages: is required"
    assert invalid_body(errors({"messages": []})).field_name == "messages"
    json_error = [{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error", "ctx": {"error": "x"}}]
    assert str(invalid_body(json_error)) == "body: not valid JSON: x"
    not_json = [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be ...", "input": b"a"}]
    assert "Content-Type: application/json" in str(invalid_body(not_json))


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (InvalidArgument("top_p", "bad"), 400, "invalid_request_error", "invalid_value"),
        (NotSupportedYet("n", "later"), 400, "invalid_request_error", "unsupported_parameter"),
        (Unauthorized("no key"), 401, "authentication_error", "invalid_api_key"),
        (ModelNotFound("a", "b"), 404, "not_found_error", "model_not_found"),
        (ResourceExhausted("queue full"), 429, "rate_limit_error", "queue_full"),
        (Unavailable("no mesh"), 503, "service_unavailable_error", "service_unavailable"),
        (Cancelled("shutting down"), 503, "service_unavailable_error", "cancelled"),
        (Internal("bug"), 500, "internal_server_error", "internal_error"),
        (MeshError("?"), 500, "internal_server_error", "internal_error"),
    ],
)  # fmt: skip
def test_errors_in_openai_shape(error: MeshError, status: int, kind: str, code: str) -> None:
    got_status, body = error_body(error)
    assert got_status == status and set(body) == {"error"}
    assert body["error"] == {"message": str(error), "type": kind, "param": getattr(error, "field_name", None),
                             "code": code}  # fmt: skip
    if isinstance(error, ModelNotFound):
        assert body["error"]["param"] == "model"


def _summary(reason: FinishReason, completion: int) -> Summary:
    return Summary(reason, 4, completion, Timings(0.0, 0.0, (), 0.0))


def test_answers_and_chunks(model_files: ModelFiles) -> None:
    ids = ids_of(model_files, "Hé")  # "é" is two byte tokens: the first adds no text
    deltas = ["H", "", "é"]
    events = [TokenEvent(i, t, -0.5 * (i + 1), d) for i, (t, d) in enumerate(zip(ids, deltas, strict=True))]
    events[-1] = TokenEvent(2, ids[2], float("-inf"), "é", _summary(FinishReason.EOS, 3))

    chat = Answer("chat", "chatcmpl-x", "m", ResponseOptions(False, False, True, False), model_files.tokenizer)
    for e in events:
        chat.add(e)
    body = chat.body()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hé"}
    assert body["choices"][0]["finish_reason"] == "stop" and body["object"] == "chat.completion"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -1.0, -9999.0]  # -inf has no JSON: vLLM's floor
    assert content[0] == {"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []}

    text = Answer("text", "cmpl-x", "m", ResponseOptions(True, True, True, True), model_files.tokenizer)
    chunks = [text.chunk(e) for e in events]
    assert [c["choices"][0]["text"] for c in chunks] == deltas  # with logprobs every token has its chunk
    assert [c["choices"][0]["logprobs"]["tokens"] for c in chunks] == [[f"token_id:{t}"] for t in ids]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0], [1], [1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all(c["usage"] is None for c in chunks) and text.opening() is None
    assert text.usage_chunk() == {"id": "cmpl-x", "object": "text_completion", "created": text.created, "model": "m",
                                  "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                                           "total_tokens": 7}}  # fmt: skip

    plain = Answer("chat", "chatcmpl-y", "m", ResponseOptions(True, False, False, False), model_files.tokenizer)
    assert plain.opening()["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    chunks = [plain.chunk(e) for e in events]
    assert chunks[1] is None  # no text, no logprobs, not the last: nothing to send
    assert [c["choices"][0]["delta"] for c in (chunks[0], chunks[2])] == [{"content": "H"}, {"content": "é"}]
    assert "usage" not in chunks[0] and plain.usage_chunk() is None


def test_top_logprobs_in_openai_shapes(model_files: ModelFiles) -> None:
    """Chat: `content[i].top_logprobs`, the n alternatives; completions: a dict of the alternatives' texts and the
    sampled token's, as vLLM renders them; `token_id:N` with return_tokens_as_token_ids."""
    h, i, j = ids_of(model_files, "Hij")
    top = ((i, -0.25), (h, -1.5), (j, float("-inf")))  # the sampled token (h) is not the most likely one
    events = [TokenEvent(0, h, -1.5, "H", _summary(FinishReason.STOP_TOKEN, 1), top)]
    chat = Answer("chat", "chatcmpl-x", "m", ResponseOptions(False, False, True, False), model_files.tokenizer)
    chat.add(events[0])
    (content,) = chat.body()["choices"][0]["logprobs"]["content"]
    assert content == {"token": "H", "logprob": -1.5, "bytes": [72], "top_logprobs": [
        {"token": "i", "logprob": -0.25, "bytes": [105]}, {"token": "H", "logprob": -1.5, "bytes": [72]},
        {"token": "j", "logprob": -9999.0, "bytes": [106]}]}  # fmt: skip
    assert chat.body()["choices"][0]["finish_reason"] == "stop"

    text = Answer("text", "cmpl-x", "m", ResponseOptions(True, False, True, True), model_files.tokenizer)
    chunk = text.chunk(TokenEvent(0, j, -3.0, "j", None, top[:2]))  # the sampled token is not among the top 2
    assert chunk["choices"][0]["logprobs"]["top_logprobs"] == [
        {f"token_id:{i}": -0.25, f"token_id:{h}": -1.5, f"token_id:{j}": -3.0}]  # fmt: skip
    named = Answer("text", "cmpl-y", "m", ResponseOptions(False, False, True, False), model_files.tokenizer)
    named.add(events[0])
    assert named.body()["choices"][0]["logprobs"]["top_logprobs"] == [{"i": -0.25, "H": -1.5, "j": -9999.0}]
