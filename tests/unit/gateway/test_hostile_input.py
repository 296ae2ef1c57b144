"""Hostile input contained: the byte bound on prompts (and that it is a true bound, for every kind of tokenizer the
supported families use), limits on chat messages and token ids checked before any work in proportion to them,
tokenizing off the request thread without holding the interpreter lock, the HTTP API's bound on request bodies,
and a request the gateway never served because it shut down failing UNAVAILABLE (gRPC unary and streaming, HTTP).
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gateway.body_limit import BodyLimit, Pace
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.process import GatewayConfig, GatewayServer
from gateway.requests import (
    MAX_CHAT_MESSAGES,
    GenerateCall,
    GenerateParams,
    ModelContext,
    PromptInput,
    prepare,
    prompt_bytes_limit,
)
from gateway.tokenizing import TokenizerPool
from gateway.watcher import ModelFiles
from shardmesh.core.errors import InvalidArgument, ResourceExhausted
from shardmesh.models.tokenizer import Tokenizer
from shardmesh.proto.v1 import gateway_pb2, gateway_pb2_grpc
from tests.unit.gateway.fakes import VOCAB, FakeMesh, FakeSource, LogLines, mesh_state
from tests.waiting import WAIT_S, wait_until

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # the fake tokenizer's: the longest is 13 bytes


class Spy:
    """A tokenizer that counts what it is asked to do."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.max_bytes_per_token = tokenizer.max_bytes_per_token
        self.encoded: list[int] = []  # the length of every text encoded
        self.rendered = 0

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        self.encoded.append(len(text))
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        self.rendered += 1
        return self._tokenizer.apply_chat_template(messages)


def _context(tokenizer: Any, max_context: int = 32) -> ModelContext:
    return ModelContext(VOCAB, max_context, tokenizer, frozenset({VOCAB - 1}), default_max_new_tokens=4)


def _prepare(prompt: PromptInput, model: ModelContext, pool: TokenizerPool | None = None) -> Any:
    return prepare(GenerateCall("r", prompt, GenerateParams()), model, 0.0, pool)


def _refusal(prompt: PromptInput, model: ModelContext) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as e:
        _prepare(prompt, model)
    return e.value


def test_the_fake_tokenizers_bound_is_its_longest_token(model_files: ModelFiles) -> None:
    assert model_files.tokenizer.max_bytes_per_token == max(len(t) for t in ADDED) == 13


def test_a_prompt_whose_bytes_cannot_fit_is_refused_before_tokenizing(model_files: ModelFiles) -> None:
    spy = Spy(model_files.tokenizer)
    model = _context(spy)
    limit = prompt_bytes_limit(model)
    assert limit == 32 * 13
    e = _refusal(PromptInput("prompt", text="x" * (limit + 1)), model)
    assert e.field_name == "prompt" and f"more than the {limit} that could fit the context of 32" in str(e)
    e = _refusal(PromptInput("prompt", text="é" * (limit // 2 + 1)), model)  # fewer characters than the limit
    assert f"{limit + 2} bytes, more than the {limit}" in str(e)
    e = _refusal(PromptInput("prompt", text="x" * 20_000_000), model)  # not even encoded to count its bytes
    assert "at least 20000000 bytes" in str(e)
    assert spy.encoded == []
    # At the limit it is tokenized, and refused by its token count as before.
    e = _refusal(PromptInput("prompt", text="x" * limit), model)
    assert f"{limit} prompt tokens do not fit the context of 32 tokens" in str(e) and spy.encoded == [limit]


def test_a_lone_surrogate_is_refused_naming_the_field(model_files: ModelFiles) -> None:
    """JSON can carry one (`"\\ud800"`); the tokenizer cannot take it."""
    model = _context(model_files.tokenizer)
    call = CompletionRequest(prompt="ab\ud800").generate_call("r")
    with pytest.raises(
        InvalidArgument, match=r"^prompt: not valid Unicode text: surrogates not allowed at character 2"
    ):
        prepare(call, model, 0.0)
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, {"role": "user", "content": "\udfff"}])
    with pytest.raises(InvalidArgument, match=r"^messages\[1\]\.content: not valid Unicode text"), body.openai_names():
        prepare(body.generate_call("r"), model, 0.0)


def test_chat_limits_are_checked_before_the_template_runs(model_files: ModelFiles) -> None:
    spy = Spy(model_files.tokenizer)
    model = _context(spy)
    limit = prompt_bytes_limit(model)

    def chat(*contents: str, role: str = "user") -> PromptInput:
        pb = gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(
            messages=[gateway_pb2.ChatMessage(role=role, content=c) for c in contents]))  # fmt: skip
        return PromptInput.from_pb(pb)

    with pytest.raises(InvalidArgument, match=rf"^chat.messages: at most {MAX_CHAT_MESSAGES} messages, got 4097"):
        chat(*["a"] * (MAX_CHAT_MESSAGES + 1))
    with pytest.raises(InvalidArgument, match=r"^chat.messages\[0\].role: at most 64 characters, got 65"):
        chat("a", role="r" * 65)
    e = _refusal(chat("x" * (limit // 2), "y" * (limit // 2 + 1)), model)
    assert e.field_name == "chat.messages" and f"{limit + 1} bytes, more than the {limit}" in str(e)
    assert spy.rendered == 0 and spy.encoded == []
    # The contents fit the bound, the rendered prompt (roles and markers added) does not: not tokenized either.
    e = _refusal(chat("x" * (limit - 5)), model)
    assert e.field_name == "chat.messages" and "the chat template's prompt is" in str(e)
    assert spy.rendered == 1 and spy.encoded == []
    # Over HTTP the same limits name OpenAI's fields.
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "a"}] * (MAX_CHAT_MESSAGES + 1))
    with pytest.raises(InvalidArgument, match=rf"^messages: at most {MAX_CHAT_MESSAGES} messages"):
        body.generate_call("r")
    body = ChatCompletionRequest(messages=[{"role": "r" * 65, "content": "a"}])
    with pytest.raises(InvalidArgument, match=r"^messages\[0\].role: at most 64 characters"):
        body.generate_call("r")


class Uncopyable(Sequence[int]):
    """Token ids that may be counted but not read: reading them would cost time and memory in their number."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        raise AssertionError("token ids read before they were counted")


def test_token_ids_are_counted_before_they_are_copied(model_files: ModelFiles) -> None:
    e = _refusal(PromptInput("token_ids", token_ids=Uncopyable(64 * 1024 * 1024)), _context(model_files.tokenizer))
    assert e.field_name == "token_ids" and "67108864 prompt tokens do not fit the context of 32" in str(e)
    # From gRPC the ids stay in the message until then.
    pb = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[5] * 40))
    prompt = PromptInput.from_pb(pb)
    assert not isinstance(prompt.token_ids, tuple)
    assert "40 prompt tokens do not fit" in str(_refusal(prompt, _context(model_files.tokenizer)))


# -- the bound is a bound: no text tokenizes to fewer tokens than its bytes / max_bytes_per_token ----------------


def _byte_level_with_long_tokens(path: Path, normalizer: Any = None) -> Tokenizer:
    """Byte-level BPE whose merges make tokens of up to 8 spaces, 'a's or 'k's, and one of the Hangul syllable
    '각' (3 bytes), which NFC composes from three jamo of 3 bytes each. No added token: the longest token is 8 bytes."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = []
    for c in ("Ġ", "a", "k"):
        for n in (1, 2, 4):
            merges.append((c * n, c * n))
            vocab.setdefault(c * 2 * n, len(vocab))
    ((syllable, _),) = byte_level.pre_tokenize_str("각")
    merges += [(syllable[0], syllable[1]), (syllable[:2], syllable[2])]
    vocab.update({syllable[:2]: len(vocab), syllable: len(vocab) + 1})
    backend = Backend(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizer
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer is not None
    return tokenizer


def _sentencepiece_like(path: Path) -> Tokenizer:
    """Llama 2's kind: '▁' for spaces (a normalizer that prepends and replaces), pieces, byte fallback."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁", "a", "b", "▁a", "▁ab", "ab", "▁▁", "▁▁▁▁"):
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "a"), ("▁a", "b"), ("a", "b"), ("▁", "▁"), ("▁▁", "▁▁")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, model_files: ModelFiles) -> dict[str, Tokenizer]:
    from tokenizers import normalizers

    root = tmp_path_factory.mktemp("bounds")
    return {
        "byte-level": model_files.tokenizer,
        "byte-level-long-tokens": _byte_level_with_long_tokens(root / "long"),
        "byte-level-nfc": _byte_level_with_long_tokens(root / "nfc", normalizers.NFC()),
        "byte-level-lowercase": _byte_level_with_long_tokens(root / "lower", normalizers.Lowercase()),
        "sentencepiece": _sentencepiece_like(root / "sp"),
    }


def test_each_kind_of_tokenizer_gets_its_bound(tokenizers: dict[str, Tokenizer]) -> None:
    bounds = {name: t.max_bytes_per_token for name, t in tokenizers.items()}
    # the added token (13 bytes); 8-byte merges; the same ×3 for the shrinking normalizers; '▁▁▁▁' (12 bytes in
    # UTF-8, for 4 bytes of text): an over-estimate, which is safe
    assert bounds == {"byte-level": 13, "byte-level-long-tokens": 8, "byte-level-nfc": 24,
                      "byte-level-lowercase": 24, "sentencepiece": 12}  # fmt: skip


PIECES = ["a", "A", "k", " ", "\n", "é", "\u1100\u1161\u11a8", "\u1100", "\u1161", "\u212a", "\u2126", "中", "🙂",
          "<|endoftext|>", "ab"]  # fmt: skip
TEXT = st.lists(st.sampled_from(PIECES), max_size=300).map("".join) | st.text(max_size=200)
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


@FUZZ
@given(text=TEXT)
@example(text="\u1100\u1161\u11a8" * 3)  # each tokenizer's worst case, always tried: three syllables by NFC,
@example(text="\u212a" * 8)  # 'kkkkkkkk' after lowercasing,
@example(text=" " * 64 + "a" * 64)  # its longest tokens,
@example(text="<|endoftext|>" * 3)  # its added token
def test_no_text_tokenizes_to_fewer_tokens_than_the_bound_allows(tokenizers: dict[str, Tokenizer], text: str) -> None:
    """Hangul jamo (which NFC composes), the Kelvin and Ohm signs (which lowercasing shortens), long runs of spaces
    and letters (the longest tokens), added tokens written in the text, and any text at all."""
    for name, tokenizer in tokenizers.items():
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert len(text.encode()) <= tokens * tokenizer.max_bytes_per_token, (name, text)


# -- tokenizing: off the request thread, the interpreter lock released, a bounded backlog -----------------------


def test_large_prompts_go_to_the_pool_and_small_ones_stay() -> None:
    pool = TokenizerPool(workers=1, max_waiting=2, small=100)
    assert pool.run(lambda: threading.current_thread().name, 100) == threading.current_thread().name
    assert pool.run(lambda: threading.current_thread().name, 101).startswith("tokenizer")
    with pytest.raises(ValueError, match="boom"):  # what the work raises reaches the caller
        pool.run(lambda: (_ for _ in ()).throw(ValueError("boom")), 101)
    assert pool.pending == 0


def test_the_pool_refuses_more_than_its_backlog() -> None:
    pool = TokenizerPool(workers=1, max_waiting=2, small=0)
    release, started = threading.Event(), threading.Event()
    results: list[str] = []

    def work() -> str:
        started.set()
        assert release.wait(WAIT_S)
        return "done"

    threads = [threading.Thread(target=lambda: results.append(pool.run(work, 1))) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: pool.pending == 2)
    with pytest.raises(ResourceExhausted, match="tokenizer busy: 2 long prompts"):
        pool.run(lambda: "third", 1)
    release.set()
    for t in threads:
        t.join(WAIT_S)
    assert results == ["done", "done"] and pool.pending == 0
    assert pool.run(lambda: "again", 1) == "again"


def test_encoding_lets_other_threads_run(model_files: ModelFiles) -> None:
    """While one thread encodes a long text, another keeps running Python. Holding the interpreter lock through the
    whole encoding (as `tokenizers`' plain `encode` does) would let it run at most once or twice in between."""
    tokenizer, text = model_files.tokenizer, "The capital of France is Paris. " * 40_000
    inside, done = threading.Event(), threading.Event()

    def encode() -> None:
        inside.set()
        tokenizer.encode(text, add_special_tokens=False)
        done.set()

    t = threading.Thread(target=encode)
    t.start()
    assert inside.wait(WAIT_S)
    observed = 0
    while not done.is_set():
        observed += 1
        done.wait(0.001)
    t.join(WAIT_S)
    assert observed >= 20, observed


# -- HTTP: request bodies ------------------------------------------------------------------------------------


def _post(url: str, data: bytes | Iterator[bytes], headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chunked(data: bytes) -> Iterator[bytes]:
    for i in range(0, len(data), 65536):
        yield data[i : i + 65536]


@pytest.fixture
def gateway(model_files: ModelFiles) -> Iterator[tuple[GatewayServer, FakeMesh, LogLines]]:
    logs, mesh = LogLines(), FakeMesh(pp=1, tp=1, kv_slots=1, max_context=48)
    cfg = GatewayConfig(listen="127.0.0.1:0", coordinator="unused:1", max_queue=8, default_max_new_tokens=8,
                        http_listen="127.0.0.1:0", shutdown_grace=0.2)  # fmt: skip
    server = GatewayServer(cfg, logs.logger, mesh_source=FakeSource(mesh_state(mesh, model_files)))
    server.start()
    try:
        yield server, mesh, logs
    finally:
        server.stop(grace=0.0)


def test_http_bodies_are_bounded_by_what_the_model_could_use(gateway: Any) -> None:
    server, _, _ = gateway
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    limit = 6 * 48 * 13 + 32 * 48 + 1024 * 1024  # JSON escapes of the longest prompt, token ids, other fields
    too_long = json.dumps({"prompt": "x" * limit, "max_tokens": 1}).encode()
    status, body = _post(url, too_long)
    assert status == 413 and body["error"]["param"] == "body" and body["error"]["code"] == "request_too_large"
    assert f"{len(too_long)} bytes, more than the {limit} this gateway reads" in body["error"]["message"]
    status, body = _post(url, _chunked(too_long), {"Transfer-Encoding": "chunked"})  # refused as it passes it
    assert status == 413 and f"more than {limit} bytes" in body["error"]["message"]
    # Under the body limit, over what the context can hold: the prompt's own refusal, naming it.
    status, body = _post(url, json.dumps({"prompt": "x" * 48 * 13 * 2, "max_tokens": 1}).encode())
    assert status == 400 and body["error"]["param"] == "prompt" and "could fit the context of 48" in str(body)
    status, body = _post(url, json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_bodies_held_at_once_are_bounded() -> None:
    """A second body that would pass the budget is refused before it is read; one alone may use it all."""
    entered, leave = asyncio.Event(), asyncio.Event()
    seen: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        entered.set()
        await leave.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def request(limit: BodyLimit, size: int) -> int:
        scope = {"type": "http", "method": "POST", "headers": [(b"content-length", str(size).encode())]}
        messages = [{"type": "http.request", "body": b"x" * size, "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await limit(scope, receive, send)
        return sent[0]["status"]

    async def scenario() -> list[int]:
        limit = BodyLimit(app, max_bytes=lambda: 1000, budget_bytes=1000)
        first = asyncio.ensure_future(request(limit, 600))
        await entered.wait()
        assert limit.held == 600
        refused = await request(limit, 600)  # 600 + 600 > 1000, not read
        leave.set()
        statuses = [await first, refused]
        assert limit.held == 0
        statuses.append(await request(limit, 1000))  # alone, it may use the whole budget
        return statuses

    assert asyncio.run(scenario()) == [200, 429, 200]
    assert seen == [b"x" * 600, b"x" * 1000]


def test_refused_bodies_are_read_at_one_pace_for_all_requests() -> None:
    now = [100.0]
    pace = Pace(1000, clock=lambda: now[0])
    assert pace.wait(500) == 0.0  # the first bytes at once
    assert pace.wait(500) == 0.5  # after the first 500 at 1000 bytes/s, whoever asks
    assert pace.wait(1000) == 1.0
    now[0] = 103.0  # idle past the last slot: nothing owed
    assert pace.wait(10) == 0.0


# -- a request the gateway never served, because it shut down -----------------------------------------------------


def test_requests_that_never_ran_before_a_shutdown_are_unavailable(gateway: Any) -> None:
    server, mesh, logs = gateway
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = gateway_pb2_grpc.GatewayStub(channel)
    mesh.step_delay = 0.05  # 40 tokens take 2 s: longer than the grace
    params = gateway_pb2.SamplingParams(max_new_tokens=40)
    running = stub.GenerateStream(gateway_pb2.GenerateRequest(prompt="hi", params=params, request_id="running"),
                                  timeout=WAIT_S)  # fmt: skip
    assert next(running).index == 0  # it holds the only KV slot
    unary = stub.Generate.future(gateway_pb2.GenerateRequest(prompt="hi", params=params, request_id="unary"),
                                 timeout=WAIT_S)  # fmt: skip
    stream = stub.GenerateStream(gateway_pb2.GenerateRequest(prompt="hi", params=params, request_id="stream"),
                                 timeout=WAIT_S)  # fmt: skip
    http: dict[str, Any] = {}
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    asking = threading.Thread(target=lambda: http.update(answer=_post(url, json.dumps({"prompt": "hi"}).encode())))
    asking.start()
    wait_until(lambda: server.scheduler.load()[0] == 3)  # all three wait for the slot
    server.stop()
    asking.join(WAIT_S)
    with pytest.raises(grpc.RpcError) as streamed:
        next(stream)
    for error in (unary.exception(timeout=WAIT_S), streamed.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert "not served (no token was generated)" in error.details()
    status, body = http["answer"]
    assert status == 503 and body["error"]["code"] == "service_unavailable" and "not served" in body["error"]["message"]
    # the running one had tokens: cancelled, as before
    with pytest.raises(grpc.RpcError) as cancelled:
        list(running)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    not_served = {e["request_id"] for e in logs.events() if e["event"] == "request_not_served"}
    assert {"unary", "stream"} <= not_served and len(not_served) == 3
    channel.close()


# -- memory given back ------------------------------------------------------------------------------------------------


class FakeLibc:
    """glibc's mallinfo2 and malloc_trim, scripted: the arenas' free bytes at each look, and the trims asked for."""

    def __init__(self, free: list[int], stop: threading.Event) -> None:
        self.free, self.stop, self.trims = free, stop, []

    def mallinfo2(self) -> Any:
        if len(self.free) == 1:
            self.stop.set()
        return type("Info", (), {"fordblks": self.free.pop(0) if len(self.free) > 1 else self.free[0]})()

    def malloc_trim(self, pad: int) -> int:
        self.trims.append(pad)
        return 1


def test_freed_memory_is_trimmed_once_it_grew_and_again_only_after_more() -> None:
    from gateway.memory import _watch

    mb = 1024 * 1024
    # start; +50 (no); +100 since start: trim; the same free pages again: none; used again (down to 20), then freed
    # back up by 70 from there: trim
    stop = threading.Event()
    libc = FakeLibc([0, 50 * mb, 100 * mb, 100 * mb, 20 * mb, 90 * mb, 90 * mb], stop)
    _watch(libc, stop, check_s=0.0, growth=64 * mb)
    assert libc.trims == [0, 0]


def test_memory_release_is_set_up_on_glibc() -> None:
    from gateway import memory

    libc = memory.glibc()
    assert libc is not None, "glibc here (Debian): the gateway gives memory back"
    memory.release_freed_memory()
    assert any(t.name == "memory-release" for t in threading.enumerate())
    assert memory.free_in_arenas(libc) >= 0
