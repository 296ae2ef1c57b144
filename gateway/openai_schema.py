"""The OpenAI-compatible API's request bodies, and their mapping onto the gateway's own `GenerateCall`.

A chat or completion request becomes the very `GenerateCall` the gRPC servicer builds (`gateway/requests.py`):
the same checks of sampling and stop fields, then the same `prepare` (chat template, tokenization, context) and
the same scheduler. What is OpenAI-specific stays here: field names and defaults, and refusals.

- **Names.** A refusal names the field as the client sent it: `top_p`, `max_tokens` (or `max_completion_tokens`),
  `stop[1]`, `messages[0].content`, `prompt[3]`; `to_openai` renames what the shared checks call
  `params.top_p`, `params.max_new_tokens`, `token_ids.ids[3]`, ...
- **Defaults follow OpenAI, not the gRPC API**: `temperature` 1 and `top_p` 1 when left out (the gRPC API's unset
  params mean greedy); `max_tokens` left out means the gateway's `--default-max-new-tokens`, capped to the context.
- **Sampling as vLLM's**: `frequency_penalty`, `presence_penalty`, and vLLM's extensions `repetition_penalty`,
  `min_p`, `top_k`, `ignore_eos` and `stop_token_ids` map onto the same `GenerateParams` fields as gRPC's, checked
  by the same code; `logprobs` with `top_logprobs` (chat) or `logprobs: N` (completions) onto `top_logprobs`.
- **Unknown fields are ignored**, as vLLM and OpenAI's own server do, so clients that send newer fields still work.
  Fields this gateway knows but cannot honour yet (n > 1, logit_bias, tools, ...) are refused with 400 naming the
  field whenever they are set to anything but their neutral value: never silently dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_errors import NotSupportedYet
from gateway.requests import MAX_CHAT_MESSAGES, GenerateCall, GenerateParams, PromptInput, Sampling, chat_turns
from shardmesh.core.errors import InvalidArgument, MeshError
from shardmesh.core.step import MAX_TOP_LOGPROBS  # OpenAI's bound for chat's top_logprobs, vLLM's default max_logprobs

MAX_SEED = 2**64 - 1  # the gateway's seeds are uint64


@dataclass(frozen=True)
class ResponseOptions:
    """What shapes the response rather than the tokens: streaming, usage and logprobs."""

    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the token counts
    logprobs: bool  # each generated token's logprob, and its top_logprobs alternatives when asked for
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:N"


class _Body(BaseModel):
    # Unknown fields are ignored (not refused), like vLLM and OpenAI's own server: see the module docstring.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = False


class ContentPart(_Body):
    """One part of a message's content; only text parts are served (the models here read text only)."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    tool_calls: list[Any] | None = None  # refused when set: this gateway has no tools

    def text(self, where: str) -> str:
        """The content as one string: text parts joined by newlines (as vLLM does); None is empty."""
        if self.tool_calls:
            raise NotSupportedYet(f"{where}.tool_calls", "this gateway does not call tools")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text":
                raise NotSupportedYet(f"{where}.content[{j}].type", f"only text parts are served, got {part.type!r}")
            texts.append(part.text or "")
        return "\n".join(texts)


class _Generation(_Body):
    """Fields chat and completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension; 0 or -1: no limit
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; not used
    return_tokens_as_token_ids: bool | None = False
    frequency_penalty: float | None = None  # [-2, 2]
    presence_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # vLLM's extension (transformers'): > 0; 1 means none
    min_p: float | None = None  # vLLM's extension: [0, 1]
    ignore_eos: bool | None = None  # vLLM's extension
    stop_token_ids: list[int] | None = None  # vLLM's extension
    # Known, not implemented yet: refused unless neutral (see `_refuse_unsupported`).
    logit_bias: dict[str, float] | None = None

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    def _max_new_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 0

    def _refuse_unsupported(self) -> None:
        if self.n is not None and self.n < 1:
            raise InvalidArgument("n", f"must be >= 1, got {self.n}")
        if self.n is not None and self.n > 1:
            raise NotSupportedYet("n", f"one choice per request; send n=1 or leave it out (got {self.n})")
        if self.logit_bias:
            raise NotSupportedYet("logit_bias", "logit biases are not applied; leave it out")

    def _top_logprobs(self) -> int:
        """The alternatives to return per token (the subclasses' fields differ)."""
        return 0

    def _params(self) -> GenerateParams:
        max_new = self._max_new_tokens()
        if max_new < 0 or (max_new == 0 and self._max_tokens_given()):
            raise InvalidArgument(self.max_tokens_field, f"must be >= 1, got {max_new}")
        top_k = self.top_k if self.top_k is not None else 0
        if top_k == -1:  # vLLM's spelling of "no limit"
            top_k = 0
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgument("seed", f"must be in [0, 2^64), got {self.seed}")
        sampling = Sampling(
            temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0), top_k=top_k, seed=self.seed,
            repetition_penalty=_or(self.repetition_penalty, 1.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0), min_p=_or(self.min_p, 0.0),
            top_logprobs=self._top_logprobs(),
        )  # fmt: skip
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerateParams(max_new_tokens=max_new, sampling=sampling, stop=stop,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=bool(self.ignore_eos))  # fmt: skip

    def _max_tokens_given(self) -> bool:
        return self.max_tokens is not None

    def _call(self, request_id: str, prompt: Callable[[], PromptInput]) -> GenerateCall:
        with self.openai_names():
            self._refuse_unsupported()
            return GenerateCall(request_id, prompt(), self._params())

    def renamed(self, error: MeshError) -> MeshError:
        """`error` naming this request's OpenAI field rather than the gateway's own (`params.top_p` -> `top_p`)."""
        return to_openai(error, self.max_tokens_field, single_stop=isinstance(self.stop, str))

    @contextlib.contextmanager
    def openai_names(self) -> Iterator[None]:
        """Re-raise the shared checks' InvalidArgument (here and in `prepare`) with this request's field names."""
        try:
            yield
        except InvalidArgument as e:
            renamed = self.renamed(e)
            if renamed is e:
                raise
            raise renamed from None

    def _options(self, logprobs: bool) -> ResponseOptions:
        include_usage = bool(self.stream_options and self.stream_options.include_usage)
        if include_usage and not self.stream:
            raise InvalidArgument("stream_options", "only allowed with stream: true")
        return ResponseOptions(bool(self.stream), include_usage, logprobs, bool(self.return_tokens_as_token_ids))


class ChatCompletionRequest(_Generation):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Known, not served: refused when set (see `_refuse_unsupported`).
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _max_new_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super()._max_new_tokens()

    def _max_tokens_given(self) -> bool:
        return self.max_completion_tokens is not None or self.max_tokens is not None

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        if self.tools or self.functions:
            raise NotSupportedYet("tools" if self.tools else "functions", "this gateway does not call tools")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none", "auto"):
                raise NotSupportedYet(name, "this gateway does not call tools")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise NotSupportedYet("response_format", "structured output is not supported; leave it out or send "
                                                     '{"type": "text"}')  # fmt: skip

    def _top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def _prompt(self) -> PromptInput:
        if len(self.messages) > MAX_CHAT_MESSAGES:  # before the contents are joined
            raise InvalidArgument("messages", f"at most {MAX_CHAT_MESSAGES} messages, got {len(self.messages)}")
        turns = chat_turns([(m.role, m.text(f"messages[{i}]")) for i, m in enumerate(self.messages)])
        return PromptInput("chat", chat=turns)

    def generate_call(self, request_id: str) -> GenerateCall:
        """The request as the gateway runs it; InvalidArgument (400) naming the OpenAI field otherwise."""
        return self._call(request_id, self._prompt)

    def options(self) -> ResponseOptions:
        return self._options(bool(self.logprobs))


class CompletionRequest(_Generation):
    """`POST /v1/completions`: `prompt` is one string or one list of token ids (a batch of several is refused)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # legacy API: the top-n alternatives per token, the sampled one besides them
    # Known, not served: refused when set.
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def _refuse_unsupported(self) -> None:
        super()._refuse_unsupported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.echo:
            raise NotSupportedYet("echo", "the prompt is not echoed; leave it out")
        if self.best_of is not None and self.best_of != 1:
            raise NotSupportedYet("best_of", "one sequence is generated per request; send 1 or leave it out")
        if self.suffix:
            raise NotSupportedYet("suffix", "insertion (suffix) is not supported; leave it out")

    def _top_logprobs(self) -> int:
        return self.logprobs or 0

    def _prompt(self) -> PromptInput:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise NotSupportedYet("prompt", f"one prompt per request (got a batch of {len(prompt)}); send each "
                                                "as its own request")  # fmt: skip
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt", "must not be empty")
            return PromptInput("prompt", text=prompt)
        if not prompt:
            raise InvalidArgument("prompt", "at least one token id is needed")
        return PromptInput("token_ids", token_ids=tuple(prompt))  # type: ignore[arg-type]

    def generate_call(self, request_id: str) -> GenerateCall:
        """The request as the gateway runs it; InvalidArgument (400) naming the OpenAI field otherwise."""
        return self._call(request_id, self._prompt)

    def options(self) -> ResponseOptions:
        return self._options(self.logprobs is not None)


def _or(value: float | None, default: float) -> float:
    return value if value is not None else default


# -- field names ------------------------------------------------------------------------------------------------

# The shared checks name gRPC fields; OpenAI clients sent these instead.
_RENAMED = {"chat": "messages", "chat.messages": "messages", "token_ids": "prompt", "token_ids.ids": "prompt",
            "input": "prompt"}  # fmt: skip


def openai_field(name: str, max_tokens_field: str = "max_tokens", single_stop: bool = False) -> str:
    """The OpenAI request field that the gateway's own field `name` stands for."""
    name = name.removeprefix("params.")
    if name == "max_new_tokens":
        return max_tokens_field
    if single_stop and name.startswith("stop["):  # `stop` was one string, not a list
        return "stop"
    for grpc_name in ("chat.messages", "token_ids.ids"):
        if name.startswith(grpc_name + "["):
            return _RENAMED[grpc_name] + name[len(grpc_name) :]
    return _RENAMED.get(name, name)


def to_openai(error: MeshError, max_tokens_field: str = "max_tokens", single_stop: bool = False) -> MeshError:
    """`error` with the field it names renamed to the OpenAI field; other errors unchanged."""
    if type(error) is not InvalidArgument:
        return error
    field = openai_field(error.field_name, max_tokens_field, single_stop)
    message = str(error).removeprefix(f"{error.field_name}: ").replace("max_new_tokens", max_tokens_field)
    return InvalidArgument(field, message)
