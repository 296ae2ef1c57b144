"""Dispatch: the steps in flight on the mesh, the chain they run in, and how one fails.

Every StepRequest names the step dispatched before it on the same placement (`after_step_id`), and the
workers run them in that order, so stage 0 runs one micro-batch while stage 1 runs the previous one. A
new chain (after a failure, or on other workers) starts with `after_step_id` 0, and only once every step
of the old one is over. A step is sent to every shard without waiting; it completes when every shard has
answered or one failed (a `ShardFailure` naming the worker). A step that fails, or a move to other
workers, leaves the other steps in flight SETTLE_S to finish before their calls are cancelled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from gateway import wire
from gateway.batching import Planned
from gateway.fanout import SETTLE_S, MeshView, ShardFailure, StepCall
from gateway.observe import GatewayObserver, StepTrace
from gateway.sequence import Sequence
from shardmesh.proto.v1 import worker_pb2


@dataclass
class PipelineStats:
    """How full the scheduler kept the pipeline, since it started."""

    steps: int = 0  # steps dispatched
    overlapped: int = 0  # of those, dispatched while another step was in flight
    max_in_flight: int = 0  # the most steps in flight at once


@dataclass(eq=False)
class StepInFlight:
    """A micro-batch in flight: what it carries, and the calls collecting every shard's answer."""

    step_id: int
    view: MeshView
    seq: int  # MeshState.seq it was planned on: a failure makes that mesh unusable
    planned: list[Planned[Sequence]]
    started: float
    traced: StepTrace | None
    call: StepCall
    resumes: tuple[int, ...]  # each planned sequence's `resumes` when sent: an answer for a log since replayed is void
    decode_steps: int = 1  # decode steps the call runs: each sampled entry gets that many tokens, step-major

    def current(self, i: int) -> bool:
        """Whether planned entry i still speaks for its sequence's cache (it has not resumed since)."""
        return self.planned[i].seq.resumes == self.resumes[i]

    def response(self) -> worker_pb2.StepResponse:
        """The sampler's answer, one token per sampled entry and decode step; raises ShardFailure. Only once done."""
        response = self.call.result()
        sampled = sum(1 for p in self.planned if p.sample) * self.decode_steps
        if len(response.tokens) != sampled:
            raise ShardFailure(self.view.sampler, ValueError(
                f"answered {len(response.tokens)} tokens for {sampled} sampled entries"))  # fmt: skip
        return response


class Dispatcher:
    """The steps in flight, in dispatch order. Owned by the scheduler thread; `stats` is thread-safe."""

    def __init__(self, step_timeout: float, observer: GatewayObserver | None, on_done: Callable[[], None]) -> None:
        self._step_timeout = step_timeout
        self._obs = observer
        self._on_done = on_done  # runs on a gRPC thread when a step completes: wakes the scheduler
        self.steps: list[StepInFlight] = []
        self._chain: tuple[Any, int] | None = None  # (placement, step id) the next step runs after
        self._step_id = 0
        self._stats_lock = threading.Lock()
        self._stats = PipelineStats()

    def stats(self) -> PipelineStats:
        """A copy of the pipeline counters."""
        with self._stats_lock:
            return replace(self._stats)

    def _chained_after(self, view: MeshView) -> int | None:
        """The step a step on `view` runs after; None when it starts a new chain."""
        chain = self._chain
        return chain[1] if chain is not None and chain[0] == view.placement else None

    def may_start(self, view: MeshView) -> bool:
        """Whether a step on `view` can go now: it continues the chain, or no old step is left."""
        return not self.steps or self._chained_after(view) is not None

    def start(self, view: MeshView, planned: list[Planned[Sequence]], seq: int, started: float,
              decode_steps: int = 1) -> StepInFlight:  # fmt: skip
        """Send one micro-batch to every shard, chained after the previous step on this placement; `decode_steps`
        decode steps of it in the one call."""
        self._step_id += 1
        after = self._chained_after(view) or 0
        self._chain = (view.placement, self._step_id)
        for p in planned:
            if p.seq.first_step_at is None:
                p.seq.first_step_at = started
        request = wire.step_request(self._step_id, view.version, after, planned, view.pp, decode_steps)
        obs, in_flight = self._obs, len(self.steps) + 1
        traced = None
        if obs is not None:
            traced = obs.step_started(self._step_id, view, planned, in_flight, after, decode_steps)
        # Each decode step of the call gets the step timeout: a slow shard's 8 steps are not one step's overrun.
        call = view.start_step(request, self._step_timeout * decode_steps,
                               traced.metadata if traced is not None else None, self._on_done)  # fmt: skip
        step = StepInFlight(self._step_id, view, seq, planned, started, traced, call,
                            tuple(p.seq.resumes for p in planned), decode_steps)  # fmt: skip
        for p in planned:
            p.seq.in_flight = True
        self.steps.append(step)
        with self._stats_lock:
            self._stats.steps += 1
            self._stats.overlapped += int(in_flight > 1)
            self._stats.max_in_flight = max(self._stats.max_in_flight, in_flight)
        return step

    def completed(self, now: float) -> Iterator[StepInFlight]:
        """Each step whose shards have all answered (or that failed, or is past its backstop), taken out
        of flight, in dispatch order; lazily, so that a step's completion is handled before the next is looked at."""
        for step in list(self.steps):
            step.call.expire_if_overdue(now)
            if step.call.done():
                self.steps.remove(step)
                yield step

    def break_chain(self) -> None:
        """The next step starts a new chain (the mesh it ran on failed, or is gone)."""
        self._chain = None

    def settle(self, keep: MeshView | None = None) -> None:
        """Give the steps in flight (but those on `keep`'s placement) SETTLE_S, then cancel their calls."""
        for step in self.steps:
            if keep is None or step.view.placement != keep.placement:
                step.call.cancel_after(SETTLE_S)

    def next_deadline(self, now: float) -> float | None:
        """The earliest backstop deadline of a step not yet overdue."""
        return min((s.call.deadline for s in self.steps if s.call.deadline > now), default=None)
