"""One complete topology as the gateway drives it: a stub per shard, and the fan-out of each step.

Every shard gets the same `StepRequest` (the first stage embeds, later stages receive activations
over torch.distributed, so all of them must run the step), and the step is over only when every
shard answered. Steps are started without waiting (`StepCall`), so that several can be in flight:
the workers run them in the order `after_step_id` chains them. The first failure cancels the other
calls and is reported as `ShardFailure` naming the worker, so the scheduler can fail the requests
and wait for the coordinator to publish a repaired mesh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardmesh.proto.v1 import worker_pb2


@dataclass(frozen=True)
class ShardClient:
    """One shard (stage × tp rank) and the StageWorker stub that reaches it."""

    stage: int
    tp_rank: int
    address: str
    worker_id: str
    stub: Any  # worker_pb2_grpc.StageWorkerStub, or a test double with the same `.Step.future`
    layers: tuple[int, int] = (0, 0)  # the stage's [layer_start, layer_end)
    kv_cache_id: str = ""  # the holder's KV cache as the topology names it (gateway/retention.py)

    def describe(self) -> str:
        return f"worker {self.address} (stage {self.stage}, tp rank {self.tp_rank})"


class ShardFailure(Exception):
    """A shard's call failed; `str()` is "worker ADDR (stage s, tp rank t) lost: CODE: details"."""

    def __init__(self, shard: ShardClient, error: BaseException) -> None:
        super().__init__(f"{shard.describe()} lost: {describe_rpc_error(error)}")
        self.shard = shard
        self.error = error


def describe_rpc_error(error: BaseException) -> str:
    """`CODE: details` for a gRPC error, the exception's text otherwise."""
    code = getattr(error, "code", None)
    if callable(code):
        details = error.details() if callable(getattr(error, "details", None)) else ""  # type: ignore[attr-defined]
        name = getattr(code(), "name", str(code()))
        return f"{name}: {details}"
    return f"{type(error).__name__}: {error}"


@dataclass(frozen=True)
class MeshView:
    """A complete topology's shards with stubs, and the limits every shard was sized for.

    `placement` identifies the processes behind the ranks (rendezvous and worker per slot): while it
    is unchanged, a newer topology version keeps the workers' KV caches, so running requests go on;
    when it changes, running requests resume on the new one, replaying their logs on the stages whose
    caches are gone (`gateway/retention.py`).
    """

    version: int
    placement: tuple[Any, ...]
    pp: int
    tp: int
    kv_slots: int
    max_context: int
    max_batch_tokens: int
    vocab_size: int
    shards: tuple[ShardClient, ...]  # global-rank order: stage-major
    kv_block_size: int = 0  # a paged KV cache's tokens per block; 0: slots (`ServingLimits`)
    kv_blocks: int = 0  # a paged KV cache's blocks, the same ids on every shard

    @property
    def sampler(self) -> ShardClient:
        """Last stage, tp rank 0: the shard whose response carries the sampled tokens."""
        return self.shards[(self.pp - 1) * self.tp]

    def start_step(self, request: worker_pb2.StepRequest, timeout: float,
                   metadata: Sequence[tuple[str, str]] | None = None,
                   on_done: Callable[[], None] = lambda: None) -> StepCall:  # fmt: skip
        """Send `request` to every shard and return at once; `on_done()` runs (on a gRPC thread) when
        every shard has answered or the step has failed. `metadata`: trace context for the workers'
        spans (only when the step is traced)."""
        kw: dict[str, Any] = {"timeout": timeout} if metadata is None else {"timeout": timeout, "metadata": metadata}
        calls = [(shard, shard.stub.Step.future(request, **kw)) for shard in self.shards]
        return StepCall(calls, (self.pp - 1) * self.tp, timeout, on_done)

    def release(self, sequences: Sequence[worker_pb2.ReleasedSequence], timeout: float) -> list[ShardFailure]:
        """Tell every shard to free these slots; returns the failures (a dead worker holds nothing)."""
        request = worker_pb2.ReleaseRequest(sequences=sequences)
        calls = [(shard, shard.stub.Release.future(request, timeout=timeout)) for shard in self.shards]
        failures: list[ShardFailure] = []
        for shard, future in calls:
            try:
                future.result(timeout=timeout + 1.0)
            except Exception as e:  # grpc.RpcError, FutureTimeoutError: reported, not raised
                failures.append(ShardFailure(shard, e))
        return failures


SETTLE_S = 1.0  # after a shard failed, how long the others get to finish the step before being cancelled
BACKSTOP_S = 5.0  # past the RPC deadline, when a step with a shard still silent counts as failed anyway


class StepCall:
    """One step's RPCs to every shard, collected as they complete: nobody blocks on them, so the
    scheduler can keep other steps in flight meanwhile.

    On the first failure the other shards get SETTLE_S to finish before their calls are cancelled:
    a surviving shard still running the failed step could otherwise get the Release that follows
    first and then re-occupy the slot with the step's tail. The step is done when every call has
    ended (answered, failed or cancelled); its result is the sampler's response or the first
    failure, as a ShardFailure naming the worker.
    """

    def __init__(self, calls: list[tuple[ShardClient, Any]], sampler: int, timeout: float,
                 on_done: Callable[[], None]) -> None:  # fmt: skip
        self._calls, self._sampler, self._on_done = calls, sampler, on_done
        self._lock = threading.Lock()
        self._pending = len(calls)
        self._responses: list[Any] = [None] * len(calls)
        self._failure: ShardFailure | None = None
        self._settle: threading.Timer | None = None
        self.deadline = time.monotonic() + timeout + BACKSTOP_S
        self._timeout = timeout
        for i, (_, future) in enumerate(calls):
            future.add_done_callback(lambda f, i=i: self._answered(i, f))

    def done(self) -> bool:
        with self._lock:
            return self._pending == 0

    def result(self) -> Any:
        """The sampler's StepResponse; raises the first ShardFailure. Only once `done()`."""
        with self._lock:
            assert self._pending == 0, "StepCall.result() before every shard answered"
            if self._failure is not None:
                raise self._failure
            return self._responses[self._sampler]

    def cancel_after(self, settle: float) -> None:
        """Give the shards `settle` seconds, then cancel what is still running (another step failed)."""
        with self._lock:
            self._settle_locked(settle)

    def expire_if_overdue(self, now: float) -> None:
        """Backstop for a shard that never answers, not even with the RPC deadline: the step is over
        (failed) now, whatever its calls do later."""
        if now < self.deadline:
            return
        with self._lock:
            if self._pending == 0:
                return
            if self._failure is None:
                silent = next((shard for (shard, f) in self._calls if not f.done()), self._calls[0][0])
                self._failure = ShardFailure(silent, TimeoutError(f"no answer within {self._timeout:.0f} s"))
            self._pending = 0
        self._cancel_all()

    def _answered(self, i: int, future: Any) -> None:
        try:
            response, error = future.result(), None
        except Exception as e:  # grpc.RpcError, or the cancellation of a settled call
            response, error = None, e
        with self._lock:
            if self._pending == 0:  # given up on by the backstop
                return
            self._responses[i] = response
            self._pending -= 1
            if error is not None and self._failure is None:
                self._failure = ShardFailure(self._calls[i][0], error)
                self._settle_locked(min(SETTLE_S, self._timeout))
            finished = self._pending == 0
        if finished:
            if self._settle is not None:
                self._settle.cancel()
            self._on_done()

    def _settle_locked(self, settle: float) -> None:
        if self._pending > 0 and self._settle is None:
            self._settle = threading.Timer(settle, self._cancel_all)
            self._settle.daemon = True
            self._settle.start()

    def _cancel_all(self) -> None:
        for _, future in self._calls:
            future.cancel()
