"""The gateway without real workers: validation, text deltas, the scheduler against a fake mesh of
shards (which check slots and positions like real workers), and the gRPC servicer in process.

The fake mesh answers in microseconds, so every test here is about ordering and bookkeeping, not
model output: which entries share a step, which slot a request gets, what gets released where.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.fanout import MeshView, ShardClient
from gateway.process import GatewayConfig, GatewayServer
from gateway.requests import GenerateCall, ModelContext, PreparedRequest, Sampling, prepare
from gateway.results import EndEvent, Event, FinishReason, RequestHandle, TokenEvent, is_last
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.servicer import SERVICE_NAME
from gateway.text import CompletionText
from gateway.watcher import MeshState, ModelFiles
from shardmesh.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from shardmesh.core.topology import (
    Calibration,
    CalibrationStatus,
    ModelSpec,
    Rendezvous,
    ServingLimits,
    ShardAssignment,
    ShardState,
    Stage,
    Topology,
)
from shardmesh.proto.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WAIT_S = 10.0  # upper bound for anything a test waits on; normally milliseconds


# -- a tiny byte-level tokenizer: one token per UTF-8 byte, so "é" is two tokens ----------------------


def write_tokenizer(model_dir: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model_dir.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(model_dir / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|im_end|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    files = ModelFiles.load(str(write_tokenizer(tmp_path_factory.mktemp("tok") / "model")))
    assert files.tokenizer is not None and not files.problem
    return files


def ids_of(files: ModelFiles, text: str) -> list[int]:
    return files.tokenizer.encode(text, add_special_tokens=False)


def eos_of(files: ModelFiles) -> int:
    return next(iter(files.eos_token_ids))


VOCAB = 259


# -- fake shards -----------------------------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class FakeShard:
    """One shard's bookkeeping, checked like a real worker would: the slot is in range and not held by
    another request, start_pos equals what that slot has cached, token_ids match num_tokens."""

    def __init__(self, mesh: FakeMesh, stage: int, tp_rank: int) -> None:
        self.mesh, self.stage, self.tp_rank = mesh, stage, tp_rank
        self.address = f"127.0.0.1:{7000 + stage * 10 + tp_rank}"
        self.slots: dict[int, tuple[str, int]] = {}  # slot -> (request id, tokens cached)
        self.steps: list[worker_pb2.StepRequest] = []
        self.releases: list[worker_pb2.ReleaseRequest] = []
        self.lock = threading.Lock()

    @property
    def is_sampler(self) -> bool:
        return self.stage == self.mesh.pp - 1 and self.tp_rank == 0

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        mesh = self.mesh
        mesh.entered.set()
        time.sleep(mesh.step_delay)
        if mesh.gate is not None and not mesh.gate.wait(WAIT_S):
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "gate never opened")
        failure = mesh.failures.pop((self.stage, self.tp_rank), None)
        if failure is not None:
            raise FakeRpcError(*failure)
        with self.lock:
            self.steps.append(req)
            if req.topology_version not in mesh.versions:
                raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, f"version {req.topology_version}")
            tokens = []
            for e in req.entries:
                if not 0 <= e.slot < mesh.kv_slots:
                    raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"slot {e.slot} out of range")
                owner = self.slots.get(e.slot)
                expected = (e.request_id, e.start_pos) if e.start_pos else None
                if e.start_pos == 0 and owner is not None and owner[0] != e.request_id:
                    raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"slot {e.slot} held by {owner[0]}")
                if expected is not None and owner != expected:
                    raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"slot {e.slot} has {owner}, not {expected}")
                if len(e.token_ids) != e.num_tokens or e.start_pos + e.num_tokens > mesh.max_context:
                    raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"bad entry {e}")
                self.slots[e.slot] = (e.request_id, e.start_pos + e.num_tokens)
                if self.is_sampler and not e.skip_sampling:
                    tokens.append(mesh.draw(e))
        return worker_pb2.StepResponse(step_id=req.step_id, tokens=tokens if self.is_sampler else [])

    def release(self, req: worker_pb2.ReleaseRequest) -> worker_pb2.ReleaseResponse:
        with self.lock:
            self.releases.append(req)
            for s in req.sequences:
                if self.slots.get(s.slot, ("",))[0] == s.request_id:
                    del self.slots[s.slot]
            return worker_pb2.ReleaseResponse(free_slots=self.mesh.kv_slots - len(self.slots))

    def released_ids(self) -> list[str]:
        with self.lock:
            return [s.request_id for r in self.releases for s in r.sequences]


class _FutureMethod:
    """`stub.Step.future(request, timeout=...)` over a thread pool, like a gRPC future."""

    def __init__(self, fn: Callable[[Any], Any], pool: futures.ThreadPoolExecutor) -> None:
        self._fn, self._pool = fn, pool

    def future(self, request: Any, timeout: float | None = None) -> futures.Future:
        return self._pool.submit(self._fn, request)


class _FakeStub:
    def __init__(self, shard: FakeShard, pool: futures.ThreadPoolExecutor) -> None:
        self.Step = _FutureMethod(shard.step, pool)
        self.Release = _FutureMethod(shard.release, pool)


class FakeMesh:
    """pp × tp fake shards; the sampler draws `script[request_id]` in order, then `filler` tokens."""

    def __init__(self, pp: int = 2, tp: int = 2, kv_slots: int = 4, max_context: int = 64,
                 max_batch_tokens: int = 64, filler: int = 72) -> None:  # fmt: skip
        self.pp, self.tp, self.kv_slots = pp, tp, kv_slots
        self.max_context, self.max_batch_tokens, self.filler = max_context, max_batch_tokens, filler
        self.script: dict[str, list[int]] = {}
        self.default_script: list[int] = []
        self.drawn: dict[str, int] = {}
        self.failures: dict[tuple[int, int], tuple[grpc.StatusCode, str]] = {}
        self.gate: threading.Event | None = None
        self.step_delay = 0.0
        self.entered = threading.Event()
        self.versions = {1}
        self.pool = futures.ThreadPoolExecutor(max_workers=4 * pp * tp)
        self.shards = [FakeShard(self, s, t) for s in range(pp) for t in range(tp)]

    def draw(self, e: worker_pb2.BatchEntry) -> worker_pb2.SampledToken:
        n = self.drawn.get(e.request_id, 0)
        self.drawn[e.request_id] = n + 1
        script = self.script.get(e.request_id, self.default_script)
        token = script[n] if n < len(script) else self.filler
        return worker_pb2.SampledToken(request_id=e.request_id, token_id=token, logprob=-(n + 1) / 10)

    def view(self, version: int = 1, placement: str = "epoch-1") -> MeshView:
        self.versions.add(version)
        shards = tuple(ShardClient(sh.stage, sh.tp_rank, sh.address, f"w{i}", _FakeStub(sh, self.pool))
                       for i, sh in enumerate(self.shards))  # fmt: skip
        return MeshView(version, (placement,), self.pp, self.tp, self.kv_slots, self.max_context,
                        self.max_batch_tokens, VOCAB, shards)  # fmt: skip

    def topology(self, version: int = 1, complete: bool = True, model_path: str = "/m", epoch: int = 1) -> Topology:
        stages = tuple(
            Stage(s, s, s + 1, tuple(ShardAssignment(t, s * self.tp + t, f"w{s * self.tp + t}",
                                                     self.shards[s * self.tp + t].address,
                                                     ShardState.READY if complete else ShardState.UNHEALTHY)
                                     for t in range(self.tp)))
            for s in range(self.pp)
        )  # fmt: skip
        return Topology(version, ModelSpec(model_path, "float32", "LlamaForCausalLM", self.pp, 8, VOCAB,
                                           self.max_context), self.pp, self.tp, stages,
                        Rendezvous("127.0.0.1", 1, f"topo/v{epoch}", epoch, self.pp * self.tp), complete,
                        ServingLimits(self.kv_slots, self.max_context, self.max_batch_tokens),
                        Calibration(CalibrationStatus.BALANCED, epoch, passed=True))  # fmt: skip

    def all_steps(self) -> list[list[worker_pb2.StepRequest]]:
        return [list(sh.steps) for sh in self.shards]


def mesh_state(mesh: FakeMesh, files: ModelFiles, seq: int = 1, version: int = 1, placement: str = "epoch-1",
               complete: bool = True) -> MeshState:  # fmt: skip
    view = mesh.view(version, placement) if complete else None
    reason = "" if complete else f"topology v{version} is not complete"
    return MeshState(seq, mesh.topology(version, complete, model_path=files.path), view, files, reason)


# -- helpers around the scheduler -------------------------------------------------------------------------


@pytest.fixture
def logger() -> Any:
    return structlog.wrap_logger(structlog.PrintLogger(io.StringIO()), processors=[structlog.processors.JSONRenderer()])


@pytest.fixture
def scheduler(logger: Any) -> Iterator[Scheduler]:
    s = Scheduler(SchedulerConfig(max_queue=8, default_max_new_tokens=16, step_timeout=5.0), logger)
    s.start()
    yield s
    s.shutdown(grace=0.0)


def request(files: ModelFiles, request_id: str, prompt: str = "hi", max_new: int = 8,
            stop: tuple[str, ...] = (), prompt_ids: list[int] | None = None) -> PreparedRequest:  # fmt: skip
    ids = tuple(prompt_ids if prompt_ids is not None else ids_of(files, prompt))
    return PreparedRequest(request_id, ids, max_new, Sampling(), stop, files.eos_token_ids, files.tokenizer,
                           time.monotonic())  # fmt: skip


def collect(handle: RequestHandle) -> list[Event]:
    events: list[Event] = []
    while not events or not is_last(events[-1]):
        events.append(handle.events.get(timeout=WAIT_S))
    return events


def tokens(events: list[Event]) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def text(events: list[Event]) -> str:
    return "".join(e.text_delta for e in events)


def finish(events: list[Event]) -> FinishReason | None:
    summary = events[-1].summary
    return summary.finish_reason if summary is not None else None


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


# -- validation ------------------------------------------------------------------------------------------


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


# -- text deltas -----------------------------------------------------------------------------------------


def _deltas(files: ModelFiles, completion: str, stop: tuple[str, ...]) -> tuple[list[str], CompletionText]:
    out = CompletionText(files.tokenizer, stop)
    deltas = []
    for token in ids_of(files, completion):
        deltas.append(out.add(token))
        if out.stopped:
            break
    deltas.append(out.finish())
    return deltas, out


def test_text_deltas_hold_back_partial_utf8_and_possible_stop_strings(model_files: ModelFiles) -> None:
    deltas, out = _deltas(model_files, "héllo 👋", ())
    assert "".join(deltas) == out.text == "héllo 👋" and "\ufffd" not in "".join(deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # the first byte of "é" alone is not text yet
    deltas, out = _deltas(model_files, "one END two", ("END",))
    assert out.stopped and out.text == "one " == "".join(deltas)
    assert deltas[4:6] == ["", ""]  # "E", "N" held back: they could be the start of "END"
    deltas, out = _deltas(model_files, "an ENd", ("END",))
    assert not out.stopped and "".join(deltas) == "an ENd"  # held back, then released
    deltas, out = _deltas(model_files, "ab<|x", ("b<", "<|x"))
    assert out.text == "a"  # the earliest stop string wins


# -- the scheduler ---------------------------------------------------------------------------------------


def test_requests_are_batched_into_one_step(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=2)  # one stage: one step in flight (pp=2 pipelines them: tests/test_pipeline.py)
    mesh.gate = threading.Event()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    first = scheduler.submit(request(model_files, "a", "hello", max_new=3))
    assert mesh.entered.wait(WAIT_S)  # step 1 (a's prompt) is in flight and held
    others = [scheduler.submit(request(model_files, rid, "yo", max_new=3)) for rid in ("b", "c")]
    mesh.gate.set()
    results = [collect(h) for h in (first, *others)]
    assert [len(tokens(r)) for r in results] == [3, 3, 3]
    assert all(finish(r) is FinishReason.LENGTH for r in results)
    steps = mesh.shards[0].steps
    # Step 2: a's first decode next to b's and c's whole prompts, each in its own slot.
    assert [(e.request_id, e.slot, e.start_pos, e.num_tokens) for e in steps[1].entries] == [
        ("a", 0, 5, 1), ("b", 1, 0, 2), ("c", 2, 0, 2),
    ]  # fmt: skip
    assert [e.request_id for e in steps[2].entries] == ["a", "b", "c"]  # then decodes only
    assert len(steps) == 4
    # Every shard got exactly the same steps, in the same order, and released all three.
    for shard in mesh.shards:
        assert shard.steps == steps
        wait_until(lambda shard=shard: sorted(shard.released_ids()) == ["a", "b", "c"])
        assert shard.slots == {}


def test_slots_are_reused_after_release(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=8, step_timeout=5.0), logger)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=2, kv_slots=2)
        scheduler.update_mesh(mesh_state(mesh, model_files))
        handles = [scheduler.submit(request(model_files, f"r{i}", max_new=2 + i)) for i in range(4)]
        results = [collect(h) for h in handles]
        assert [len(tokens(r)) for r in results] == [2, 3, 4, 5]
        first_step = {}
        for i, step in enumerate(mesh.shards[0].steps):
            for e in step.entries:
                first_step.setdefault(e.request_id, (i, e.slot))
        # Two slots: r2 takes r0's slot once r0 is released, r3 takes r1's.
        assert first_step["r0"][1] == first_step["r2"][1] == 0 and first_step["r1"][1] == first_step["r3"][1] == 1
        assert first_step["r2"][0] > first_step["r0"][0]
        for shard in mesh.shards:  # the last release happens just after the last token is sent
            wait_until(lambda shard=shard: shard.released_ids() == ["r0", "r1", "r2", "r3"])
            assert shard.slots == {}
    finally:
        scheduler.shutdown(grace=0.0)


def test_eos_and_stop_strings_end_generation(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    eos = eos_of(model_files)
    mesh.script["eos"] = [*ids_of(model_files, "hi"), eos, *ids_of(model_files, "never")]
    mesh.script["stop"] = ids_of(model_files, "Hé, world!\nUser: more")
    eos_events = collect(scheduler.submit(request(model_files, "eos", max_new=10)))
    assert tokens(eos_events) == [*ids_of(model_files, "hi"), eos]  # the eos token is returned, its text is not
    assert text(eos_events) == "hi" and finish(eos_events) is FinishReason.STOP
    stop_events = collect(scheduler.submit(request(model_files, "stop", max_new=40, stop=("\nUser:", "zz"))))
    assert text(stop_events) == "Hé, world!" and finish(stop_events) is FinishReason.STOP
    assert tokens(stop_events) == ids_of(model_files, "Hé, world!\nUser:")  # up to the token completing it
    summary = stop_events[-1].summary
    assert summary is not None and summary.completion_tokens == len(tokens(stop_events))
    assert summary.prompt_tokens == 2
    assert [e.index for e in stop_events] == list(range(len(stop_events)))
    assert all(e.summary is None for e in stop_events[:-1])


def test_max_new_tokens_and_timings(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=2, tp=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    events = collect(scheduler.submit(request(model_files, "len", max_new=5)))
    assert len(tokens(events)) == 5 and finish(events) is FinishReason.LENGTH
    assert [e.logprob for e in events] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    t = events[-1].summary.timings
    assert 0 <= t.queue_ms <= t.time_to_first_token_ms <= t.total_ms
    assert len(t.inter_token_ms) == 4 and t.mean_inter_token_ms == pytest.approx(sum(t.inter_token_ms) / 4)


def test_long_prompts_are_chunked_to_the_batch_budget(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1, max_batch_tokens=4)  # one step in flight, so both share every step
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    short = scheduler.submit(request(model_files, "short", "ab", max_new=4))
    assert mesh.entered.wait(WAIT_S)
    long = scheduler.submit(request(model_files, "long", "0123456789", max_new=2))
    mesh.gate.set()
    assert len(tokens(collect(short))) == 4 and len(tokens(collect(long))) == 2
    plan = [[(e.request_id, e.start_pos, e.num_tokens, e.skip_sampling) for e in s.entries]
            for s in mesh.shards[-1].steps]  # fmt: skip
    assert plan[:5] == [
        [("short", 0, 2, False)],
        [("short", 2, 1, False), ("long", 0, 3, True)],  # decode first, the prompt gets what is left
        [("short", 3, 1, False), ("long", 3, 3, True)],
        [("short", 4, 1, False), ("long", 6, 3, True)],
        [("long", 9, 1, False)],  # the last chunk samples
    ]
    assert all(sum(e.num_tokens for e in s.entries) <= 4 for s in mesh.shards[-1].steps)


def test_cancellation_releases_on_every_shard(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=2, tp=2)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    handle = scheduler.submit(request(model_files, "gone", max_new=50))
    first = handle.events.get(timeout=WAIT_S)
    assert isinstance(first, TokenEvent)
    handle.cancel()
    events = [first, *collect(handle)]
    assert isinstance(events[-1], EndEvent) and finish(events) is FinishReason.CANCELLED
    assert len(tokens(events)) < 50
    for shard in mesh.shards:
        wait_until(lambda shard=shard: shard.released_ids() == ["gone"])
        assert shard.slots == {}
    # A cancelled request that was still waiting never got a slot: nothing to release.
    mesh.gate = threading.Event()
    mesh.entered.clear()
    busy = [scheduler.submit(request(model_files, f"busy{i}", max_new=2)) for i in range(4)]
    assert mesh.entered.wait(WAIT_S)
    queued = scheduler.submit(request(model_files, "queued", max_new=2))
    queued.cancel()
    mesh.gate.set()
    assert finish(collect(queued)) is FinishReason.CANCELLED
    assert all(finish(collect(h)) is FinishReason.LENGTH for h in busy)
    wait_until(lambda: len(mesh.shards[0].released_ids()) == 5)
    assert "queued" not in mesh.shards[0].released_ids()


def test_queue_full_is_resource_exhausted(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(max_queue=2, step_timeout=5.0), logger)
    scheduler.start()
    try:
        mesh = FakeMesh(pp=1, tp=1, kv_slots=2)
        mesh.gate = threading.Event()
        scheduler.update_mesh(mesh_state(mesh, model_files))
        running = scheduler.submit(request(model_files, "running", max_new=5))
        assert mesh.entered.wait(WAIT_S)  # its step is held: the others wait for the next step boundary
        # The second takes the free slot at that boundary, so it does not count as queued; two more fit.
        others = [scheduler.submit(request(model_files, f"w{i}", max_new=1)) for i in range(3)]
        with pytest.raises(ResourceExhausted, match=r"^queue full: 2 requests waiting for a KV slot"):
            scheduler.submit(request(model_files, "one-too-many"))
        # Cancelled requests leave at the next boundary (the step is still held): they no longer count.
        others[-1].cancel()
        others.append(scheduler.submit(request(model_files, "after-a-waiting-cancel", max_new=1)))
        running.cancel()  # its slot frees at the boundary too
        others.append(scheduler.submit(request(model_files, "after-a-running-cancel", max_new=1)))
        with pytest.raises(ResourceExhausted):
            scheduler.submit(request(model_files, "one-too-many-again"))
        mesh.gate.set()
        assert finish(collect(running)) is FinishReason.CANCELLED
        assert [finish(collect(h)) for h in others] == [FinishReason.LENGTH] * 2 + [FinishReason.CANCELLED] + [
            FinishReason.LENGTH
        ] * 2
    finally:
        scheduler.shutdown(grace=0.0)


def test_no_topology_is_unavailable(scheduler: Scheduler, model_files: ModelFiles) -> None:
    with pytest.raises(Unavailable, match=r"^no ready topology: waiting for the first topology"):
        scheduler.serving_context()
    mesh = FakeMesh()
    scheduler.update_mesh(mesh_state(mesh, model_files, complete=False))
    with pytest.raises(Unavailable, match=r"^no ready topology: topology v1 is not complete"):
        scheduler.submit(request(model_files, "x"))


def test_worker_failure_fails_the_step_and_waits_for_a_new_topology(
    scheduler: Scheduler, model_files: ModelFiles
) -> None:
    mesh = FakeMesh(pp=2, tp=2, kv_slots=1)
    ready: list[bool] = []
    scheduler.add_ready_listener(ready.append)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.gate = threading.Event()
    doomed = scheduler.submit(request(model_files, "doomed", max_new=20))
    assert mesh.entered.wait(WAIT_S)
    queued = scheduler.submit(request(model_files, "queued", max_new=2))  # no slot: waits through the failure
    mesh.failures[(1, 1)] = (grpc.StatusCode.UNAVAILABLE, "Connection refused")
    mesh.gate.set()
    end = collect(doomed)[-1]
    assert isinstance(end, EndEvent) and isinstance(end.error, Unavailable)
    assert str(end.error) == "worker 127.0.0.1:7011 (stage 1, tp rank 1) lost: UNAVAILABLE: Connection refused"
    for shard in mesh.shards:  # released everywhere (the fake "dead" shard answers Release too)
        wait_until(lambda shard=shard: shard.released_ids() == ["doomed"])
    wait_until(lambda: ready == [False, True, False])
    with pytest.raises(Unavailable, match=r"^no ready topology: worker 127.0.0.1:7011 .* lost: .*waiting for"):
        scheduler.submit(request(model_files, "refused"))
    # The coordinator publishes a newer complete topology (the worker is back): serving resumes, and
    # the request that was queued through the failure is served first.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2, placement="epoch-2"))
    assert finish(collect(queued)) is FinishReason.LENGTH
    after = collect(scheduler.submit(request(model_files, "after", max_new=2)))
    assert finish(after) is FinishReason.LENGTH and ready[-1] is True
    assert mesh.shards[0].steps[-1].topology_version == 2


def test_topology_versions_keep_or_drop_running_requests(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=2)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=1))
    mesh.gate = threading.Event()
    handle = scheduler.submit(request(model_files, "r", max_new=3))
    assert mesh.entered.wait(WAIT_S)
    # Same placement, newer version (e.g. a shard state refresh): the KV cache is still there.
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=2, version=2))
    mesh.gate.set()
    assert finish(collect(handle)) is FinishReason.LENGTH
    assert [s.topology_version for s in mesh.shards[0].steps] == [1, 2, 2]
    # Another placement while a request runs: its cache is gone, it fails and is released.
    mesh.gate.clear()
    mesh.entered.clear()
    handle = scheduler.submit(request(model_files, "moved", max_new=30))
    assert mesh.entered.wait(WAIT_S)
    scheduler.update_mesh(mesh_state(mesh, model_files, seq=3, version=3, placement="epoch-3"))
    mesh.gate.set()
    end = collect(handle)[-1]
    assert isinstance(end, EndEvent) and "topology changed to v3" in str(end.error)
    wait_until(lambda: "moved" in mesh.shards[1].released_ids())


def test_duplicate_request_ids_get_distinct_worker_keys(scheduler: Scheduler, model_files: ModelFiles) -> None:
    mesh = FakeMesh(pp=1, tp=1)
    mesh.gate = threading.Event()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    handles = [scheduler.submit(request(model_files, "same", max_new=2)) for _ in range(2)]
    mesh.gate.set()
    assert all(finish(collect(h)) is FinishReason.LENGTH for h in handles)
    wait_until(lambda: sorted(mesh.shards[0].released_ids()) == ["same", "same#2"])


def test_shutdown_lets_running_finish_then_cancels(logger: Any, model_files: ModelFiles) -> None:
    scheduler = Scheduler(SchedulerConfig(step_timeout=5.0), logger)
    scheduler.start()
    mesh = FakeMesh(pp=1, tp=2, kv_slots=1)
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.gate = threading.Event()
    short = scheduler.submit(request(model_files, "short", max_new=2))
    assert mesh.entered.wait(WAIT_S)
    waiting = scheduler.submit(request(model_files, "waiting", max_new=2))
    mesh.gate.set()
    scheduler.shutdown(grace=2.0)  # short finishes within the grace; waiting is cancelled at once
    assert finish(collect(short)) is FinishReason.LENGTH
    assert finish(collect(waiting)) is FinishReason.CANCELLED
    assert not scheduler.alive
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit(request(model_files, "late"))

    scheduler = Scheduler(SchedulerConfig(step_timeout=5.0), logger)
    scheduler.start()
    scheduler.update_mesh(mesh_state(mesh, model_files))
    mesh.step_delay = 0.02  # 60 tokens take 1.2 s: longer than the grace
    endless = scheduler.submit(request(model_files, "endless", max_new=60))
    assert isinstance(endless.events.get(timeout=WAIT_S), TokenEvent)
    started = time.monotonic()
    scheduler.shutdown(grace=0.2)
    assert time.monotonic() - started < 2.0
    events = collect(endless)
    assert finish(events) is FinishReason.CANCELLED and events[-1].summary.completion_tokens < 60
    assert "endless" in mesh.shards[1].released_ids()


# -- the gRPC servicer, in process -------------------------------------------------------------------------


class FakeSource:
    """A MeshSource the test drives by hand."""

    def __init__(self, state: MeshState | None = None) -> None:
        self._state = state or MeshState()
        self._callbacks: list[Callable[[MeshState], None]] = []

    def subscribe(self, callback: Callable[[MeshState], None]) -> None:
        self._callbacks.append(callback)
        callback(self._state)

    def state(self) -> MeshState:
        return self._state

    def publish(self, state: MeshState) -> None:
        self._state = state
        for callback in self._callbacks:
            callback(state)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class LogLines:
    """A structlog logger writing JSON lines into a list, with contextvars merged like the real one."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        self.logger = structlog.wrap_logger(
            structlog.PrintLogger(self.buffer),
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        )  # fmt: skip

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.buffer.getvalue().splitlines()]


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
    assert r.finish_reason == common_pb2.FINISH_REASON_STOP and len(r.logprobs) == len(r.token_ids)
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
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 3.0
        r = unary.result(timeout=5)
        assert r.finish_reason == common_pb2.FINISH_REASON_CANCELLED and 0 < len(r.token_ids) < 40
        err = _rpc_error(lambda: list(stream))
        assert err.code() == grpc.StatusCode.CANCELLED
    assert sorted(mesh.shards[0].released_ids()) == ["stream", "unary"]
