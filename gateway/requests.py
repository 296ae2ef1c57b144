"""A generation request as the gateway understands it: parsed from protobuf, validated, tokenized.

Validation happens in two steps because they need different knowledge. `GenerateCall.from_pb`
checks what the message alone can tell (one input form set, sampling ranges, stop strings);
`prepare` then needs the served model (tokenizer, vocabulary, context) and produces the
`PreparedRequest` the scheduler runs. Both raise `InvalidArgument` naming the wire field, so a
client sees `params.top_p: must be in (0, 1], got 1.5` rather than a generic refusal.

Every list and string a client sends is bounded, and checked before the gateway spends work on it in
proportion to its size: stop strings (count and length), stop token ids, chat messages (count, role
length), the request id, and the prompt itself. A prompt is refused before it is tokenized when its bytes
could not fit the context (`prompt_bytes_limit`), and token ids before they are copied when there are too
many; tokenizing happens off the request's thread (`gateway/tokenizing.py`). The message as a whole is
bounded by the server's message size limit (`--max-message-bytes`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.tokenizing import TokenizerPool, shared_pool
from shardmesh.core.errors import InvalidArgument
from shardmesh.core.step import MAX_TOP_LOGPROBS, PENALTY_RANGE, penalized
from shardmesh.proto.v1 import gateway_pb2

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16  # OpenAI allows 4; vLLM any number. Each is matched against the text at every token.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# A chat template runs a loop over the messages in Python: bounded, like the prompt's bytes. Long agent
# conversations run to hundreds of turns; every template of the supported families spends tokens on each one.
MAX_CHAT_MESSAGES = 4096
MAX_ROLE_CHARS = 64  # "system", "user", "assistant", "tool", "developer", ...


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

    @property
    def penalized(self) -> bool:
        """Whether a penalty is set: the draw then depends on the sequence's token history."""
        return penalized(self.repetition_penalty, self.frequency_penalty, self.presence_penalty)


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
    # From gRPC, the message's own repeated field, not a copy: `prepare` counts the ids before it copies them
    # (a 64 MiB message holds 64 million of them).
    token_ids: Sequence[int] = ()

    @classmethod
    def from_pb(cls, pb: gateway_pb2.GenerateRequest) -> PromptInput:
        # Each read of a string field makes a new Python string: read each once.
        kind = pb.WhichOneof("input")
        if kind == "prompt":
            text = pb.prompt
            if not text:
                raise InvalidArgument("prompt", "must not be empty")
            return cls(kind, text=text)
        if kind == "chat":
            messages = pb.chat.messages
            if not messages:
                raise InvalidArgument("chat.messages", "at least one message is needed")
            return cls(kind, chat=chat_turns([(m.role, m.content) for m in _at_most_messages(messages)]))
        if kind == "token_ids":
            if not pb.token_ids.ids:
                raise InvalidArgument("token_ids.ids", "at least one token id is needed")
            return cls(kind, token_ids=pb.token_ids.ids)
        raise InvalidArgument("input", "set one of prompt, chat or token_ids")


def _at_most_messages(messages: Sequence[Any]) -> Sequence[Any]:
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidArgument("chat.messages", f"at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    return messages


def chat_turns(messages: Sequence[tuple[str, str]]) -> tuple[ChatTurn, ...]:
    """(role, content) pairs as turns, the number of messages and each role checked (gRPC and HTTP alike)."""
    _at_most_messages(messages)
    for i, (role, _) in enumerate(messages):
        if not role:
            raise InvalidArgument(f"chat.messages[{i}].role", "must not be empty")
        if len(role) > MAX_ROLE_CHARS:
            raise InvalidArgument(f"chat.messages[{i}].role", f"at most {MAX_ROLE_CHARS} characters, got {len(role)}")
    return tuple(ChatTurn(role, content) for role, content in messages)


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
    """The client's id, or a fresh one; an empty string counts as unset (proto3 clients often send it). It goes back
    to the client as gRPC metadata (`request-id`), which carries printable ASCII only."""
    request_id = pb.request_id if pb.HasField("request_id") else ""
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not (request_id.isascii() and request_id.isprintable()):
        bad = next(c for c in request_id if not (c.isascii() and c.isprintable()))
        raise InvalidArgument("request_id", f"printable ASCII characters only (it is sent back as gRPC metadata), "
                                            f"got {bad!r}")  # fmt: skip
    return request_id


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


def prepare(call: GenerateCall, model: ModelContext, arrival: float,
            pool: TokenizerPool | None = None) -> PreparedRequest:  # fmt: skip
    """Tokenize (on `pool`, by default the process's) and check `call` against the model. The prompt
    must leave room for at least one generated token: `prompt_tokens >= max_context` is refused, as is
    an explicit max_new_tokens that would overflow the context. The default length is capped to what
    fits."""
    where = call.input.kind
    ids = _prompt_ids(call.input, model, pool if pool is not None else shared_pool())
    if not ids:
        raise InvalidArgument(where, "tokenizes to no tokens")
    if len(ids) >= model.max_context:
        raise InvalidArgument(
            where, f"{len(ids)} prompt tokens do not fit the context of {model.max_context} tokens "
                   f"(at most {model.max_context - 1}, to leave room for one generated token)",
        )  # fmt: skip
    ids = tuple(ids)
    for i, token in enumerate(ids):
        if not 0 <= token < model.vocab_size:
            name = f"token_ids.ids[{i}]" if where == "token_ids" else where
            raise InvalidArgument(name, f"token id {token} is outside the vocabulary [0, {model.vocab_size})")
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
    return PreparedRequest(call.request_id, ids, max_new, params.sampling, params.stop, eos, model.tokenizer,
                           arrival, frozenset(params.stop_token_ids))  # fmt: skip


def prompt_bytes_limit(model: ModelContext) -> int:
    """The most bytes of text that could tokenize to fewer than `max_context` tokens: no token stands for more
    than `max_bytes_per_token` bytes (`shardmesh.models.tokenizer.Tokenizer.max_bytes_per_token`: 81 for
    SmolLM2, whose longest token is a newline and 80 spaces), so a longer text has at least `max_context` tokens
    and cannot leave room for one generated token. This bounds the work and memory tokenizing can cost: about a
    microsecond and 100 bytes of memory per byte of text here (SmolLM2 at 8192 tokens: 663 KB, ~0.7 s, ~70 MB)."""
    return model.max_context * model.tokenizer.max_bytes_per_token


def _prompt_ids(prompt: PromptInput, model: ModelContext, pool: TokenizerPool) -> Sequence[int]:
    """`prompt` is raw text tokenized as is (BOS added like the offline `--raw` mode); `chat` goes
    through the model's chat template, which supplies its own special tokens. Text that could not fit
    the context is refused before any of that."""
    if prompt.kind == "token_ids":
        return prompt.token_ids
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InvalidArgument(prompt.kind, "the model has no tokenizer.json: send token_ids instead")
    limit = prompt_bytes_limit(model)
    if prompt.kind == "prompt":
        size = _utf8_size("prompt", [prompt.text], limit, model)
        return pool.run(lambda: tokenizer.encode(prompt.text, add_special_tokens=True), size)
    if not model.has_chat_template:
        raise InvalidArgument("chat", "the model has no chat template: send a prompt or token_ids instead")
    # The templates of the supported families write every message's content: when the contents alone could not
    # fit, neither can the rendered prompt, and the template is not run over them.
    size = _utf8_size("chat.messages", [t.content for t in prompt.chat], limit, model)
    messages = [{"role": t.role, "content": t.content} for t in prompt.chat]

    def render_and_encode() -> list[int]:
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as e:  # the template refused the conversation (raise_exception)
            raise InvalidArgument("chat.messages", str(e)) from None
        _utf8_size("chat.messages", [text], limit, model, rendered=True)
        return tokenizer.encode(text, add_special_tokens=False)

    return pool.run(render_and_encode, size)


def _utf8_size(where: str, texts: list[str], limit: int, model: ModelContext, rendered: bool = False) -> int:
    """The UTF-8 size of `texts` together, refused naming `where` when over `limit`. A character is 1 to 4 bytes,
    so a text of more than `limit` characters is refused without encoding it (encoding holds the interpreter
    lock for as long as the text is long)."""
    size, counted = 0, True
    for i, text in enumerate(texts):
        if len(text) > limit - size:
            size, counted = size + len(text), False
            break
        try:
            size += len(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \ud800 escapes can carry
            name = f"{where}[{i}].content" if where == "chat.messages" and not rendered else where
            raise InvalidArgument(name, f"not valid Unicode text: {e.reason} at character {e.start}") from None
    if size > limit:
        what = "the chat template's prompt" if rendered else "the text"
        shown = f"{size} bytes" if counted else f"at least {size} bytes"
        raise InvalidArgument(
            where, f"{what} is {shown}, more than the {limit} that could fit the context of {model.max_context} "
                   f"tokens (a token of this model stands for at most {limit // model.max_context} bytes of text)",
        )  # fmt: skip
    return size
