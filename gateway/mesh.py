"""One complete topology as the gateway drives it: a stub per shard, and the lock-step fan-out.

Every shard gets the same `StepRequest` at once (the first stage embeds, later stages receive
activations over torch.distributed, so all of them must run the step together), and the step is
over only when every shard answered. The first failure cancels the other calls and is reported as
`ShardFailure` naming the worker, so the scheduler can fail that step's requests and wait for the
coordinator to publish a repaired mesh.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Sequence
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
    when it changes, their cached prompts are gone.
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

    @property
    def sampler(self) -> ShardClient:
        """Last stage, tp rank 0: the shard whose response carries the sampled tokens."""
        return self.shards[(self.pp - 1) * self.tp]

    def step(
        self, request: worker_pb2.StepRequest, timeout: float, metadata: Sequence[tuple[str, str]] | None = None
    ) -> worker_pb2.StepResponse:
        """Run `request` on every shard; the sampler's response, or ShardFailure for the first failure.
        `metadata`: trace context for the workers' spans (only when the step is traced)."""
        kw: dict[str, Any] = {"timeout": timeout} if metadata is None else {"timeout": timeout, "metadata": metadata}
        calls = [(shard, shard.stub.Step.future(request, **kw)) for shard in self.shards]
        responses = _gather(calls, timeout)
        return responses[(self.pp - 1) * self.tp]

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


def _gather(calls: list[tuple[ShardClient, Any]], timeout: float) -> list[Any]:
    """Wait for every future; on the first failure settle, cancel the rest and raise ShardFailure.

    Completion order, not list order: a dead worker fails in milliseconds while a live one may be
    blocked waiting for activations that will never come, so waiting in list order could hang.
    Settling (a short wait for the other shards before cancelling) is for the Release that follows:
    a surviving shard still running the failed step could otherwise get the Release first and then
    re-occupy the slot with the step's tail. A shard stuck longer than that is cancelled anyway.
    """
    done: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i, (_, future) in enumerate(calls):
        future.add_done_callback(lambda _f, i=i: done.put(i))
    results: list[Any] = [None] * len(calls)
    for _ in calls:
        try:
            i = done.get(timeout=timeout + 5.0)  # the RPC deadline fires first; this is a backstop
        except queue.Empty:
            _cancel_all(calls)
            pending = next(shard for (shard, f) in calls if not f.done())
            raise ShardFailure(pending, TimeoutError(f"no answer within {timeout:.0f} s")) from None
        shard, future = calls[i]
        try:
            results[i] = future.result()
        except Exception as e:
            _settle_then_cancel(calls, min(SETTLE_S, timeout))
            raise ShardFailure(shard, e) from None
    return results


def _settle_then_cancel(calls: list[tuple[ShardClient, Any]], settle: float) -> None:
    deadline = time.monotonic() + settle
    for _, future in calls:
        with contextlib.suppress(Exception):  # their outcome no longer matters, only that they ended
            future.result(timeout=max(0.0, deadline - time.monotonic()))
    _cancel_all(calls)


def _cancel_all(calls: list[tuple[ShardClient, Any]]) -> None:
    for _, future in calls:
        future.cancel()
