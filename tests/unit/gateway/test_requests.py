"""Request validation: every refusal names the wire field; prepare tokenizes and settles the length."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gateway.requests import GenerateCall, ModelContext, Sampling, prepare
from gateway.watcher import ModelFiles
from shardmesh.core.errors import InvalidArgument
from shardmesh.proto.v1 import gateway_pb2
from tests.unit.gateway.fakes import VOCAB, ids_of


def _params(**fields: Any) -> gateway_pb2.SamplingParams:
    return gateway_pb2.SamplingParams(max_new_tokens=2, **fields)


def _context(files: ModelFiles | None, max_context: int = 32) -> ModelContext:
    tokenizer = files.tokenizer if files else None
    eos = files.eos_token_ids if files else frozenset()
    return ModelContext(VOCAB, max_context, tokenizer, eos, default_max_new_tokens=100)


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({}, "input", "set one of prompt, chat or token_ids"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"chat": gateway_pb2.ChatMessages()}, "chat.messages", "at least one message"),
        ({"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(content="x")])},
         "chat.messages[0].role", "must not be empty"),
        ({"token_ids": gateway_pb2.TokenIds()}, "token_ids.ids", "at least one token id"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[1, 259])}, "token_ids.ids[1]", "outside the vocabulary [0, 259)"),
        ({"prompt": "x" * 32}, "prompt", "32 prompt tokens do not fit the context of 32 tokens"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(max_new_tokens=31)}, "params.max_new_tokens",
         "prompt (2 tokens) + max_new_tokens (31) exceeds the context of 32 tokens"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(temperature=0.5)}, "params.max_new_tokens",
         "must be > 0, got 0 (leave params unset for the default)"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(temperature=-0.5)}, "params.temperature", ">= 0"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(temperature=float("nan"))}, "params.temperature",
         ">= 0"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(top_p=0.0)}, "params.top_p", "(0, 1]"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(top_p=1.5)}, "params.top_p", "(0, 1]"),
        ({"prompt": "hi", "params": gateway_pb2.SamplingParams(stop=["a", ""])}, "params.stop[1]", "not be empty"),
        ({"prompt": "hi", "request_id": "r" * 129}, "request_id", "at most 128"),
        ({"prompt": "hi", "params": _params(repetition_penalty=0.0)}, "params.repetition_penalty", "> 0, got 0"),
        ({"prompt": "hi", "params": _params(repetition_penalty=float("inf"))}, "params.repetition_penalty", "> 0"),
        ({"prompt": "hi", "params": _params(frequency_penalty=2.5)}, "params.frequency_penalty", "[-2, 2], got 2.5"),
        ({"prompt": "hi", "params": _params(presence_penalty=-3)}, "params.presence_penalty", "[-2, 2], got -3"),
        ({"prompt": "hi", "params": _params(min_p=1.5)}, "params.min_p", "[0, 1], got 1.5"),
        ({"prompt": "hi", "params": _params(top_logprobs=21)}, "params.top_logprobs", "[0, 20], got 21"),
        ({"prompt": "hi", "params": _params(stop_token_ids=[5, 259])}, "params.stop_token_ids[1]",
         "token id 259 is outside the vocabulary [0, 259)"),
        ({"prompt": "hi", "params": _params(stop_token_ids=[5] * 257)}, "params.stop_token_ids", "at most 256 ids"),
    ],
)  # fmt: skip
def test_validation_names_the_field(model_files: ModelFiles, fields: dict, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(**fields)), _context(model_files), 0.0)
    assert e.value.field_name == field and message in str(e.value) and str(e.value).startswith(f"{field}: ")


def test_validation_without_tokenizer_or_template(model_files: ModelFiles) -> None:
    def refusal(ctx: ModelContext, **fields: Any) -> str:
        with pytest.raises(InvalidArgument) as e:
            prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(**fields)), ctx, 0.0)
        return str(e.value)

    no_tokenizer = _context(None)
    assert refusal(no_tokenizer, prompt="hi").startswith("prompt: the model has no tokenizer.json")
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    assert refusal(no_tokenizer, chat=chat).startswith("chat: the model has no tokenizer.json")
    params = gateway_pb2.SamplingParams(max_new_tokens=2, stop=["x"])
    assert refusal(no_tokenizer, token_ids=gateway_pb2.TokenIds(ids=[1]), params=params).startswith("params.stop:")
    no_template = replace(_context(model_files), tokenizer=ModelFiles.load(model_files.path).tokenizer)
    no_template.tokenizer.chat_template = None
    assert refusal(no_template, chat=chat).startswith("chat: the model has no chat template")
    with pytest.raises(InvalidArgument, match=r"^params.top_k: must be >= 0"):
        Sampling(top_k=-1)


def test_prepare_chat_prompt_and_defaults(model_files: ModelFiles) -> None:
    ctx = _context(model_files, max_context=40)
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    prepared = prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(chat=chat)), ctx, 0.0)
    assert list(prepared.prompt_ids) == model_files.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert prepared.max_new_tokens == 40 - len(prepared.prompt_ids)  # default 100, capped to the context
    raw = prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(prompt="hi", request_id="mine")), ctx, 0.0)
    assert raw.prompt_ids == tuple(ids_of(model_files, "hi")) and raw.request_id == "mine"  # no template
    params = gateway_pb2.SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3, seed=11)
    pb = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[3, 4]), params=params)
    explicit = prepare(GenerateCall.from_pb(pb), ctx, 0.0)
    assert explicit.max_new_tokens == 5 and len(explicit.request_id) == 32
    assert explicit.sampling == Sampling(temperature=explicit.sampling.temperature, top_p=1.0, top_k=3, seed=11)
    assert explicit.sampling.temperature == pytest.approx(0.7)


def test_prepare_penalties_stop_token_ids_and_ignore_eos(model_files: ModelFiles) -> None:
    ctx = _context(model_files, max_context=40)
    eos = next(iter(model_files.eos_token_ids))
    params = _params(repetition_penalty=1.25, frequency_penalty=-0.5, presence_penalty=2.0, min_p=0.25,
                     top_logprobs=20, stop_token_ids=[7, eos])  # fmt: skip
    prepared = prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(prompt="hi", params=params)), ctx, 0.0)
    assert prepared.sampling == Sampling(repetition_penalty=1.25, frequency_penalty=-0.5, presence_penalty=2.0,
                                         min_p=0.25, top_logprobs=20)  # fmt: skip
    assert prepared.stop_token_ids == {7, eos} and prepared.eos_token_ids == {eos}
    # ignore_eos: the model's end-of-sequence tokens end nothing (a stop token id still does)
    params = _params(ignore_eos=True, stop_token_ids=[7])
    ignoring = prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(prompt="hi", params=params)), ctx, 0.0)
    assert ignoring.eos_token_ids == frozenset() and ignoring.stop_token_ids == {7}
    # unset repetition_penalty is 1 (none), not proto3's 0
    plain = prepare(GenerateCall.from_pb(gateway_pb2.GenerateRequest(prompt="hi", params=_params())), ctx, 0.0)
    assert plain.sampling == Sampling() and plain.stop_token_ids == frozenset()
