"""A generation request as the gateway understands it: parsed from protobuf, validated, tokenized.

Validation happens in two steps because they need different knowledge. `GenerateCall.from_pb`
checks what the message alone can tell (one input form set, sampling ranges, stop strings);
`prepare` then needs the served model (tokenizer, vocabulary, context) and produces the
`PreparedRequest` the scheduler runs. Both raise `InvalidArgument` naming the wire field, so a
client sees `params.top_p: must be in (0, 1], got 1.5` rather than a generic refusal.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from shardmesh.core.errors import InvalidArgument
from shardmesh.core.step import MAX_TOP_LOGPROBS, PENALTY_RANGE
from shardmesh.proto.v1 import gateway_pb2

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class Sampling:
    """How the last stage draws tokens; mirrors the worker's `TokenSampling` (top_p and repetition_penalty
    always explicit). The ranges are vLLM's."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # (0, 1]; 1 means no nucleus filtering
    top_k: int = 0  # 0 means no limit
    seed: int | None = None  # None: the gateway picks a random one (gateway/wire.py)
    repetition_penalty: float = 1.0  # > 0; 1 means none
    frequency_penalty: float = 0.0  # [-2, 2]
    presence_penalty: float = 0.0  # [-2, 2]
    min_p: float = 0.0  # [0, 1]; 0 means none
    top_logprobs: int = 0  # alternatives returned per token, [0, 20]

    def __post_init__(self) -> None:
        # `not x >= 0` rather than `x < 0` so NaN is refused too.
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidArgument("params.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument("params.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument("params.top_k", f"must be >= 0, got {self.top_k}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise InvalidArgument("params.repetition_penalty", f"must be a finite number > 0, got "
                                                               f"{self.repetition_penalty}")  # fmt: skip
        low, high = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not low <= value <= high:
                raise InvalidArgument(f"params.{name}", f"must be in [{low:g}, {high:g}], got {value}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument("params.min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument("params.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got "
                                                         f"{self.top_logprobs}")  # fmt: skip


@dataclass(frozen=True)
class GenerateParams:
    """Sampling plus stopping, as the client asked. `max_new_tokens == 0` (only reachable by leaving
    `params` unset) means the gateway's default length; explicit params must ask for at least one
    token, so a client that forgot the field hears about it instead of getting a surprise length.
    `stop_token_ids` are checked against the vocabulary in `prepare`."""

    max_new_tokens: int = 0
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InvalidArgument("params.max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("params.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not s:
                raise InvalidArgument(f"params.stop[{i}]", "must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise InvalidArgument(f"params.stop[{i}]", f"at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument("params.stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got "
                                                           f"{len(self.stop_token_ids)}")  # fmt: skip

    @classmethod
    def of_request(cls, request: gateway_pb2.GenerateRequest) -> GenerateParams:
        """Unset `params`: greedy with the default length. Set: max_new_tokens must be > 0."""
        if not request.HasField("params"):
            return cls()
        pb = request.params
        sampling = Sampling(
            temperature=float(pb.temperature),
            top_p=float(pb.top_p) if pb.HasField("top_p") else 1.0,
            top_k=int(pb.top_k),
            seed=int(pb.seed) if pb.HasField("seed") else None,
            repetition_penalty=float(pb.repetition_penalty) if pb.HasField("repetition_penalty") else 1.0,
            frequency_penalty=float(pb.frequency_penalty),
            presence_penalty=float(pb.presence_penalty),
            min_p=float(pb.min_p),
            top_logprobs=int(pb.top_logprobs),
        )
        params = cls(max_new_tokens=int(pb.max_new_tokens), sampling=sampling, stop=tuple(pb.stop),
                     stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos)  # fmt: skip
        if params.max_new_tokens == 0:
            raise InvalidArgument("params.max_new_tokens", "must be > 0, got 0 (leave params unset for the default)")
        return params


@dataclass(frozen=True)
class ChatTurn:
    role: str
    content: str


@dataclass(frozen=True)
class PromptInput:
    """Exactly one prompt form. `kind` is the wire field's name ("prompt", "chat" or "token_ids"), so
    errors about the input can name it."""

    kind: str
    text: str = ""
    chat: tuple[ChatTurn, ...] = ()
    token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pb(cls, pb: gateway_pb2.GenerateRequest) -> PromptInput:
        kind = pb.WhichOneof("input")
        if kind == "prompt":
            if not pb.prompt:
                raise InvalidArgument("prompt", "must not be empty")
            return cls(kind, text=pb.prompt)
        if kind == "chat":
            if not pb.chat.messages:
                raise InvalidArgument("chat.messages", "at least one message is needed")
            for i, m in enumerate(pb.chat.messages):
                if not m.role:
                    raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
            return cls(kind, chat=tuple(ChatTurn(m.role, m.content) for m in pb.chat.messages))
        if kind == "token_ids":
            if not pb.token_ids.ids:
                raise InvalidArgument("token_ids.ids", "at least one token id is needed")
            return cls(kind, token_ids=tuple(pb.token_ids.ids))
        raise InvalidArgument("input", "set one of prompt, chat or token_ids")


@dataclass(frozen=True)
class GenerateCall:
    """A parsed `GenerateRequest`: everything checkable without knowing the model."""

    request_id: str
    input: PromptInput
    params: GenerateParams

    @classmethod
    def from_pb(cls, pb: gateway_pb2.GenerateRequest) -> GenerateCall:
        return cls(request_id_of(pb), PromptInput.from_pb(pb), GenerateParams.of_request(pb))


def request_id_of(pb: gateway_pb2.GenerateRequest) -> str:
    """The client's id, or a fresh one; an empty string counts as unset (proto3 clients often send it)."""
    if pb.HasField("request_id") and pb.request_id:
        if len(pb.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(pb.request_id)}")
        return pb.request_id
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ModelContext:
    """What validation and detokenization need to know about the served model right now."""

    vocab_size: int
    max_context: int  # tokens per sequence (prompt + completion) the workers' KV slots hold
    tokenizer: Any | None  # shardmesh.models.tokenizer.Tokenizer; None when the model has no tokenizer.json
    eos_token_ids: frozenset[int]
    default_max_new_tokens: int

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(self.tokenizer.chat_template)


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready to schedule: prompt tokens, a definite length budget, and how to stop: a stop string,
    an end-of-sequence id (none with ignore_eos), one of the request's stop token ids, or the length."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    eos_token_ids: frozenset[int]  # the model's, unless the request ignores them
    tokenizer: Any | None
    arrival: float  # time.monotonic() when the RPC arrived; timings are measured from here
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


def prepare(call: GenerateCall, model: ModelContext, arrival: float) -> PreparedRequest:
    """Tokenize and check `call` against the model. The prompt must leave room for at least one
    generated token: `prompt_tokens >= max_context` is refused, as is an explicit max_new_tokens
    that would overflow the context. The default length is capped to what fits."""
    where = call.input.kind
    ids = _prompt_ids(call.input, model)
    if not ids:
        raise InvalidArgument(where, "tokenizes to no tokens")
    for i, token in enumerate(ids):
        if not 0 <= token < model.vocab_size:
            name = f"token_ids.ids[{i}]" if where == "token_ids" else where
            raise InvalidArgument(name, f"token id {token} is outside the vocabulary [0, {model.vocab_size})")
    if len(ids) >= model.max_context:
        raise InvalidArgument(
            where, f"{len(ids)} prompt tokens do not fit the context of {model.max_context} tokens "
                   f"(at most {model.max_context - 1}, to leave room for one generated token)",
        )  # fmt: skip
    params = call.params
    room = model.max_context - len(ids)
    if params.max_new_tokens == 0:
        max_new = min(model.default_max_new_tokens, room)
    elif params.max_new_tokens > room:
        raise InvalidArgument(
            "params.max_new_tokens", f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                     f"exceeds the context of {model.max_context} tokens",
        )  # fmt: skip
    else:
        max_new = params.max_new_tokens
    if params.stop and model.tokenizer is None:
        raise InvalidArgument("params.stop", "the model has no tokenizer.json, so generated text (and stop strings) "
                                             "cannot be matched")  # fmt: skip
    for i, token in enumerate(params.stop_token_ids):
        if not 0 <= token < model.vocab_size:
            raise InvalidArgument(f"params.stop_token_ids[{i}]", f"token id {token} is outside the vocabulary "
                                                                 f"[0, {model.vocab_size})")  # fmt: skip
    eos = frozenset() if params.ignore_eos else model.eos_token_ids
    return PreparedRequest(call.request_id, tuple(ids), max_new, params.sampling, params.stop, eos, model.tokenizer,
                           arrival, frozenset(params.stop_token_ids))  # fmt: skip


def _prompt_ids(prompt: PromptInput, model: ModelContext) -> list[int]:
    """`prompt` is raw text tokenized as is (BOS added like the offline `--raw` mode); `chat` goes
    through the model's chat template, which supplies its own special tokens."""
    if prompt.kind == "token_ids":
        return list(prompt.token_ids)
    if model.tokenizer is None:
        raise InvalidArgument(prompt.kind, "the model has no tokenizer.json: send token_ids instead")
    if prompt.kind == "prompt":
        return model.tokenizer.encode(prompt.text, add_special_tokens=True)
    if not model.has_chat_template:
        raise InvalidArgument("chat", "the model has no chat template: send a prompt or token_ids instead")
    try:
        return model.tokenizer.encode_chat([{"role": t.role, "content": t.content} for t in prompt.chat])
    except ValueError as e:  # the template refused the conversation (raise_exception)
        raise InvalidArgument("chat.messages", str(e)) from None
