"""Fakes for the gateway's tests: a byte-level tokenizer, a mesh of fake shards that check slots and
positions like real workers, a mesh source driven by hand, a logger whose JSON lines can be read back,
and helpers around the scheduler's events.

The fake mesh answers in microseconds, so tests built on it are about ordering and bookkeeping, not
model output: which entries share a step, which slot a request gets, what gets released where.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import structlog

from gateway.fanout import MeshView, ShardClient
from gateway.requests import PreparedRequest, Sampling
from gateway.results import Event, FinishReason, RequestHandle, TokenEvent, is_last
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import MeshState, ModelFiles
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
from shardmesh.proto.v1 import common_pb2, worker_pb2
from tests.waiting import WAIT_S

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


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
    another request, start_pos is at most what that slot has cached (a real worker writes those positions again),
    token_ids match num_tokens. An entry for other stages only (a replay) leaves it alone."""

    def __init__(self, mesh: FakeMesh, stage: int, tp_rank: int) -> None:
        self.mesh, self.stage, self.tp_rank = mesh, stage, tp_rank
        self.address = f"127.0.0.1:{7000 + stage * 10 + tp_rank}"
        self.slots: dict[int, tuple[str, int]] = {}  # slot -> (request id, tokens cached)
        self.steps: list[worker_pb2.StepRequest] = []
        self.releases: list[worker_pb2.ReleaseRequest] = []
        self.blocks: dict[int, dict[int, int]] = {}  # paged: block -> {offset: token id written there}
        self.lock = threading.Lock()

    @property
    def is_sampler(self) -> bool:
        return self.stage == self.mesh.pp - 1 and self.tp_rank == 0

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        mesh = self.mesh
        mesh.entered.set()
        time.sleep(mesh.step_delay * max(1, req.decode_steps))  # each decode step of the call takes the delay
        if mesh.gate is not None and not mesh.gate.wait(WAIT_S):
            raise FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "gate never opened")
        failure = mesh.failures.pop((self.stage, self.tp_rank), None)
        if failure is not None:
            raise FakeRpcError(*failure)
        with self.lock:
            self.steps.append(req)
            if req.topology_version not in mesh.versions:
                raise FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, f"version {req.topology_version}")
            entries = list(req.entries)
            tokens = self._run(entries)
            for _ in range(req.decode_steps - 1):  # several decode steps in the call: each feeds the token drawn
                if any(e.num_tokens != 1 or e.skip_sampling or (e.first_stage, e.end_stage) != (0, 0)
                       for e in entries):  # fmt: skip
                    raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "decode_steps: not a decode on every stage")
                entries = [worker_pb2.BatchEntry(request_id=e.request_id, slot=e.slot, start_pos=e.start_pos + 1,
                                                 num_tokens=1, token_ids=[mesh.draw(e).token_id],
                                                 sampling=e.sampling, blocks=e.blocks)
                           for e in entries]  # fmt: skip
                tokens += self._run(entries)
        return worker_pb2.StepResponse(step_id=req.step_id, tokens=tokens if self.is_sampler else [])

    def _run(self, entries: list[worker_pb2.BatchEntry]) -> list[worker_pb2.SampledToken]:
        """One step's entries, checked and cached; the tokens drawn (the sampler's)."""
        mesh = self.mesh
        tokens = []
        if mesh.kv_block_size:  # like a real worker: a block has one writer per step
            writers: dict[int, str] = {}
            for e in entries:
                if e.first_stage <= self.stage < (e.end_stage or mesh.pp):
                    for p in range(e.start_pos, e.start_pos + e.num_tokens):
                        block = e.blocks[p // mesh.kv_block_size] if p // mesh.kv_block_size < len(e.blocks) else -1
                        if writers.setdefault(block, e.request_id) != e.request_id:
                            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"block {block} written twice")
        for e in entries:
            if not 0 <= e.slot < mesh.kv_slots:
                raise FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"slot {e.slot} out of range")
            if not e.first_stage <= self.stage < (e.end_stage or mesh.pp):
                continue
            owner = self.slots.get(e.slot)
            if e.start_pos == 0 and owner is not None and owner[0] != e.request_id:
                raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"slot {e.slot} held by {owner[0]}")
            paged_hit = mesh.kv_block_size and owner is None  # positions before it in shared blocks
            if e.start_pos and not paged_hit and (owner is None or owner[0] != e.request_id
                                                  or owner[1] < e.start_pos):  # fmt: skip
                wanted = f"{e.request_id} up to {e.start_pos}"
                raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"slot {e.slot} has {owner}, not {wanted}")
            if len(e.token_ids) != e.num_tokens or e.start_pos + e.num_tokens > mesh.max_context:
                raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"bad entry {e}")
            if mesh.kv_block_size:
                self._paged(e)
            self.slots[e.slot] = (e.request_id, e.start_pos + e.num_tokens)
            if self.is_sampler and not e.skip_sampling:
                tokens.append(mesh.draw(e))
        return tokens

    def _paged(self, e: worker_pb2.BatchEntry) -> None:
        """A paged mesh's entry: its table covers its positions with ids in range, every position before
        start_pos was written (by it or by the sequence whose prefix it shares), and its tokens go in."""
        bs, table = self.mesh.kv_block_size, list(e.blocks)
        end = e.start_pos + e.num_tokens
        if len(table) < -(-end // bs) or any(not 0 <= b < self.mesh.kv_blocks for b in table):
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"blocks {table} for [0, {end})")
        missing = [p for p in range(e.start_pos) if p % bs not in self.blocks.get(table[p // bs], {})]
        if missing:
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"positions {missing[:4]}... were never written")
        for i, token in enumerate(e.token_ids):
            p = e.start_pos + i
            self.blocks.setdefault(table[p // bs], {})[p % bs] = token

    def tokens_in(self, table: list[int], length: int) -> list[int]:
        """The token ids written at positions [0, length) of a block table."""
        bs = self.mesh.kv_block_size
        with self.lock:
            return [self.blocks.get(table[p // bs], {}).get(p % bs, -1) for p in range(length)]

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
        self.timeouts: list[float | None] = []  # each call's deadline, in order

    def future(self, request: Any, timeout: float | None = None) -> futures.Future:
        self.timeouts.append(timeout)
        return self._pool.submit(self._fn, request)


class _FakeStub:
    def __init__(self, shard: FakeShard, pool: futures.ThreadPoolExecutor) -> None:
        self.Step = _FutureMethod(shard.step, pool)
        self.Release = _FutureMethod(shard.release, pool)


class FakeMesh:
    """pp × tp fake shards; the sampler draws `script[request_id]` in order, then `filler` tokens. Like a real
    worker's, a draw depends on the log position it fills, not on the draws before it: a request that
    replays its log after a lost worker draws the same tokens again. Asked for top_logprobs, it answers the drawn
    token and the ids after it, each one nat less likely."""

    def __init__(self, pp: int = 2, tp: int = 2, kv_slots: int = 4, max_context: int = 64,
                 max_batch_tokens: int = 64, filler: int = 72, kv_block_size: int = 0,
                 kv_blocks: int = 0) -> None:  # fmt: skip
        self.pp, self.tp, self.kv_slots = pp, tp, kv_slots
        self.kv_block_size, self.kv_blocks = kv_block_size, kv_blocks
        self.max_context, self.max_batch_tokens, self.filler = max_context, max_batch_tokens, filler
        self.script: dict[str, list[int]] = {}
        self.default_script: list[int] = []
        self.first_draw: dict[str, int] = {}  # request key -> log position of its first draw
        self.failures: dict[tuple[int, int], tuple[grpc.StatusCode, str]] = {}
        self.gate: threading.Event | None = None
        self.step_delay = 0.0
        self.entered = threading.Event()
        self.versions = {1}
        self.pool = futures.ThreadPoolExecutor(max_workers=4 * pp * tp)
        self.shards = [FakeShard(self, s, t) for s in range(pp) for t in range(tp)]
        self.cache_ids = [""] * len(self.shards)  # each shard's kv_cache_id in the views from now on ("": unknown)

    def draw(self, e: worker_pb2.BatchEntry) -> worker_pb2.SampledToken:
        position = e.start_pos + e.num_tokens
        n = position - self.first_draw.setdefault(e.request_id, position)
        script = self.script.get(e.request_id, self.default_script)
        token = script[n] if n < len(script) else self.filler
        logprob = -(n + 1) / 10
        top = [common_pb2.TokenLogprob(token_id=(token + k) % VOCAB, logprob=logprob - k)
               for k in range(e.sampling.top_logprobs)]  # fmt: skip
        return worker_pb2.SampledToken(request_id=e.request_id, token_id=token, logprob=logprob, top_logprobs=top)

    def view(self, version: int = 1, placement: str = "epoch-1") -> MeshView:
        self.versions.add(version)
        shards = tuple(ShardClient(sh.stage, sh.tp_rank, sh.address, f"w{i}", _FakeStub(sh, self.pool),
                                   (sh.stage, sh.stage + 1), self.cache_ids[i])
                       for i, sh in enumerate(self.shards))  # fmt: skip
        return MeshView(version, (placement,), self.pp, self.tp, self.kv_slots, self.max_context,
                        self.max_batch_tokens, VOCAB, shards, self.kv_block_size, self.kv_blocks)  # fmt: skip

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
                        ServingLimits(self.kv_slots, self.max_context, self.max_batch_tokens, self.kv_block_size,
                                      self.kv_blocks),
                        Calibration(CalibrationStatus.BALANCED, epoch, passed=True))  # fmt: skip

    def all_steps(self) -> list[list[worker_pb2.StepRequest]]:
        return [list(sh.steps) for sh in self.shards]


def mesh_state(mesh: FakeMesh, files: ModelFiles, seq: int = 1, version: int = 1, placement: str = "epoch-1",
               complete: bool = True) -> MeshState:  # fmt: skip
    view = mesh.view(version, placement) if complete else None
    reason = "" if complete else f"topology v{version} is not complete"
    return MeshState(seq, mesh.topology(version, complete, model_path=files.path), view, files, reason)


# -- helpers around the scheduler -------------------------------------------------------------------------


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


# -- a mesh source and a readable logger ------------------------------------------------------------------


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


@contextlib.contextmanager
def started(cfg: SchedulerConfig, logger: Any) -> Iterator[Scheduler]:
    """A running scheduler, shut down (no grace) when the block ends."""
    s = Scheduler(cfg, logger)
    s.start()
    try:
        yield s
    finally:
        s.shutdown(grace=0.0)
