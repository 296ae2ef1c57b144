"""Continuous batching over the mesh in one thread, pipelined: a waiting queue, a running set, KV
slots, and up to one step in flight per pipeline stage.

With P pipeline stages, one step at a time leaves P - 1 stages idle while the other computes. So the
scheduler keeps up to P steps (micro-batches) in flight: the running sequences are split into
disjoint micro-batches (a sequence is in at most one step in flight, since its next input is the
token its last step sampled), and when a step completes, its sequences take their tokens and go
straight into the next micro-batch. Every StepRequest names the step dispatched before it
(`after_step_id`), and the workers run them in that order, so stage 0 runs one micro-batch while
stage 1 runs the previous one. With P = 1 there is one step at a time, as without pipelining.

Each iteration of the loop:
  1. collect the steps that completed and apply their tokens: text deltas, stop strings,
     end-of-sequence, length (a failed step: see below);
  2. end what must end: requests whose client went away (CANCELLED), requests whose workers' KV
     cache is gone (a new placement), and everything once the shutdown grace is over; a request in
     a step in flight is cancelled when that step completes;
  3. release the slots of the requests that ended and are in no step in flight, on every shard,
     and wait for the answers (a Release racing a later Step into the same slot could free the new
     request's cache);
  4. admit waiting requests while a slot is free: the gateway owns the slots, and a request keeps
     the same slot on every shard until it is released;
  5. while fewer than P steps are in flight, build one from the sequences in none, longest-waiting
     first: decode entries (1 token), then prompt entries (the whole prompt, or a chunk of what is
     left of the max_batch_tokens budget; a chunk that is not the last one skips sampling), at most
     ceil(running / P) sequences so that the running set splits into P micro-batches (new requests
     join whichever has room); send it to every shard without waiting for the answers;
  6. sleep until a step completes, a request arrives or is cancelled, or the mesh changes.

When a shard fails, nothing is served until the coordinator publishes a newer complete topology, and a
new chain of steps starts only once every old step is over; the gateway asks the coordinator to probe the
mesh's workers at once (`gateway/reporter.py`), so that a spare replaces a dead one without waiting for
its heartbeats to time out. The running requests do not fail: their KV
cache is gone with the mesh, but the gateway holds each one's token log (`gateway/sequence.py`), so they
go back to the front of the queue and, on the next complete mesh, replay their log (prefill without
sampling) and decode on; greedy and seeded tokens are the same as without the failure, and the client
sees no error and no repeated or missing token, only a longer gap. A request that cannot resume within
`resume_timeout` fails with UNAVAILABLE saying why. The same happens when the mesh moves to other
workers (a new placement). Waiting requests stay queued through all of it.

This module is the loop and what ties its parts together: the waiting queue in `gateway/admission.py`,
the free KV slots in `gateway/slots.py`, the choice of a micro-batch in `gateway/batching.py` (a pure
function), the steps in flight and their chain in `gateway/dispatch.py`, one request's tokens and stop
conditions in `gateway/sequence.py`; the worker messages are built in `gateway/wire.py`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway import wire
from gateway.admission import Admission, context_refusal
from gateway.batching import Planned, pipeline_depth, plan_micro_batch
from gateway.blocks import BlockPool, BlockTable, PoolStats, PrefixCounters
from gateway.dispatch import Dispatcher, PipelineStats, StepInFlight
from gateway.fanout import MeshView, ShardFailure
from gateway.observe import GatewayObserver, RequestTrace
from gateway.requests import ModelContext, PreparedRequest
from gateway.results import EndEvent, FinishReason, RequestHandle, Summary, TokenEvent
from gateway.retention import lost_stages
from gateway.sequence import Kept, Sequence
from gateway.slots import SlotPool
from gateway.watcher import MeshState
from shardmesh.core.errors import Internal, MeshError, Unavailable
from shardmesh.proto.v1 import worker_pb2

IDLE_WAIT_S = 0.5  # longest sleep without a wake-up; bounds how late a shutdown deadline is noticed
GATHER_WINDOWS = 10  # the longest a burst gathers, in admission windows (`Scheduler._gather`)


@dataclass(frozen=True)
class SchedulerConfig:
    max_queue: int = 256  # waiting (not yet admitted) requests; more is RESOURCE_EXHAUSTED
    default_max_new_tokens: int = 256  # for requests with max_new_tokens == 0 (capped to the context)
    step_timeout: float = 120.0  # seconds a shard may take for one step before it counts as lost
    release_timeout: float = 5.0  # seconds to wait for Release answers
    pipeline_depth: int = 0  # steps in flight at once; 0: one per pipeline stage (the mesh's pp)
    resume_timeout: float = 60.0  # seconds a request whose workers were lost may wait for a mesh to resume on
    prefix_caching: bool = True  # on a paged mesh: reuse the blocks of a cached prompt prefix (`gateway/blocks.py`)
    decode_steps: int = 1  # decode steps per call with one step in flight, at most (`Scheduler._decode_steps`)
    admission_window: float = 0.0  # seconds without an arrival a burst gets to gather (`Scheduler._gather`); 0: off


@dataclass(frozen=True)
class Vacated:
    """A KV slot a sequence held, to release on the mesh that held it (once no step in flight uses it), and on
    a paged mesh the blocks of a sequence that ended, to give back to their pool then."""

    view: MeshView | None
    slot: int
    key: str
    request_id: str
    trace_id: str
    keeps_key: bool = False  # the sequence resumes elsewhere under the same key
    blocks: tuple[BlockPool, BlockTable] | None = None

    @classmethod
    def of(cls, s: Sequence, keeps_key: bool = False) -> Vacated:
        return cls(s.view, s.slot, s.key, s.req.request_id, s.trace_id, keeps_key, _take_blocks(s))

    @classmethod
    def kept_by(cls, s: Sequence, kept: Kept, keeps_key: bool) -> Vacated:
        """The slot a resuming sequence had on the mesh it was lost on (and its blocks, when it ends)."""
        blocks = None if keeps_key else _take_blocks(s)
        return cls(kept.view, kept.slot, s.key, s.req.request_id, s.trace_id, keeps_key, blocks)


def _take_blocks(s: Sequence) -> tuple[BlockPool, BlockTable] | None:
    """The sequence's blocks, to release: it holds none after this."""
    held = (s.block_pool, s.blocks) if s.block_pool is not None and s.blocks is not None else None
    s.block_pool, s.blocks = None, None
    return held


class Scheduler:
    """Owns request admission and the step loop. Thread-safe entry points: `submit`,
    `serving_context`, `update_mesh`, `snapshot`, `pipeline_stats`, `shutdown` and `RequestHandle.cancel`."""

    def __init__(self, cfg: SchedulerConfig, logger: Any, clock: Callable[[], float] = time.monotonic,
                 observer: GatewayObserver | None = None,
                 report_failure: Callable[[list[str], str], None] | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self._log = logger
        self._clock = clock
        self._obs = observer  # tracing and metrics; None when both are off
        self._report_failure = report_failure  # (worker ids, reason) to the coordinator; never blocks or raises
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()  # orders readiness notifications; taken before _lock
        self._wakeup = threading.Event()
        # Shared with RPC threads, guarded by _lock:
        self._mesh = MeshState()
        self._served: MeshState | None = None  # the last mesh state that could serve
        self._admission = Admission(cfg.max_queue)
        self._arrivals = 0  # requests submitted since the start (`_gather` waits while it grows)
        self._failed_seq = -1  # MeshState.seq at the last step failure
        self._failure = ""
        self._closing = False
        self._deadline = 0.0
        self._ready = False
        self._ready_listeners: list[Callable[[bool], None]] = []
        # Changed by the scheduler thread only, under _lock (submit reads how many slots are free):
        self._slots = SlotPool()
        self._blocks: BlockPool | None = None  # a paged mesh's KV blocks (`gateway/blocks.py`); None: slots only
        self._prefix_counters = PrefixCounters()  # carried from one block pool to the next, for the metrics
        # Owned by the scheduler thread:
        self._running: list[Sequence] = []
        self._fresh = 0  # requests admitted since the last step was dispatched
        self._gathering = False  # the last step dispatched took new requests in: the next may wait for more
        self._to_release: list[Vacated] = []
        self._dispatch = Dispatcher(cfg.step_timeout, observer, self._wakeup.set)
        self._ready_clock = itertools.count(1)
        self._thread: threading.Thread | None = None

    # -- entry points for the RPC side ------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    def update_mesh(self, state: MeshState) -> None:
        with self._lock:
            self._mesh = state
            if state.view is not None and state.model is not None:
                self._served = state  # what requests are validated against while the mesh is changing
        self._wakeup.set()
        self._publish_ready()

    def add_ready_listener(self, callback: Callable[[bool], None]) -> None:
        """`callback(ready)` now and on every change; the server drives health from it."""
        with self._publish_lock:
            with self._lock:
                self._ready_listeners.append(callback)
                ready = self._ready
            callback(ready)

    def snapshot(self) -> tuple[MeshState, bool]:
        """The current mesh state and whether new requests are accepted."""
        with self._lock:
            return self._mesh, self._ready_locked()

    def serving_context(self) -> ModelContext:
        """The model as requests are validated against now: the current mesh's, or while it changes (see
        `submit`) the last one served; Unavailable when nothing can be served."""
        with self._lock:
            state, ready, reason = self._mesh, self._ready_locked(), self._not_ready_reason()
            if not ready and self._changing_locked():
                state, ready = self._served, True
        if not ready or state is None or state.view is None or state.model is None:
            raise Unavailable(reason)
        return ModelContext(
            vocab_size=state.view.vocab_size, max_context=state.view.max_context, tokenizer=state.model.tokenizer,
            eos_token_ids=state.model.eos_token_ids, default_max_new_tokens=self.cfg.default_max_new_tokens,
        )  # fmt: skip

    def load(self) -> tuple[int, int, int, bool]:
        """(waiting, running, free KV slots, ready), for metrics."""
        with self._lock:
            return len(self._admission), len(self._running), self._free_slots_locked(), self._ready_locked()

    def block_stats(self) -> PoolStats | None:
        """The paged mesh's KV blocks and prefix counters; None while the mesh has slots (or none yet)."""
        with self._lock:
            return self._blocks.stats() if self._blocks is not None else None

    def pipeline_stats(self) -> PipelineStats:
        """A copy of the pipeline counters."""
        return self._dispatch.stats()

    def submit(self, req: PreparedRequest, trace: RequestTrace | None = None, trace_id: str = "") -> RequestHandle:
        """Queue a request; its events arrive on the returned handle. `trace`: its spans (tracing on);
        `trace_id`: what the scheduler's log lines about it carry."""
        with self._lock:
            ready = self._ready_locked()
            if not ready and not self._changing_locked():
                raise Unavailable(self._not_ready_reason())
            handle = RequestHandle(req.request_id, self._wakeup.set)
            s = self._admission.enqueue(req, handle, self._free_slots_locked(), trace, trace_id)
            self._arrivals += 1
            if not ready:  # the mesh is changing under running requests: this one waits with them
                s.wait_for_mesh(self._clock(), self.cfg.resume_timeout, self._not_ready_reason())
            if trace is not None:
                trace.queued()
        self._wakeup.set()
        return handle

    def shutdown(self, grace: float) -> None:
        """Stop admitting, fail the waiting requests (UNAVAILABLE: not served), let running ones finish for `grace`
        seconds, then end and release them (see `_end_by_shutdown`). Returns once the loop has exited (or gave up
        waiting)."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._deadline = self._clock() + grace
        self._wakeup.set()
        self._publish_ready()
        if self._thread is not None:
            self._thread.join(timeout=grace + self.cfg.release_timeout + 2.0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- readiness --------------------------------------------------------------------------------

    def _usable_locked(self) -> bool:
        """A complete mesh that has not failed a step since it was published."""
        return self._mesh.view is not None and self._mesh.seq > self._failed_seq

    def _ready_locked(self) -> bool:
        return not self._closing and self._usable_locked()

    def _changing_locked(self) -> bool:
        """Served before and not shutting down, but no usable mesh now: a worker was lost, drained or replaced,
        and the coordinator is putting a mesh together. New requests wait for it, as the running ones do, for
        at most `resume_timeout`; health says NOT_SERVING meanwhile, so a load balancer sends them elsewhere."""
        return not self._closing and self._served is not None and not self._usable_locked()

    def _free_slots_locked(self) -> int:
        # tuple() copies the scheduler thread's list in one step under the GIL; only a count is needed.
        leaving = sum(1 for s in tuple(self._running) if s.handle.cancelled)
        return self._slots.free_count(self._mesh.view, leaving)

    def _not_ready_reason(self) -> str:
        if self._closing:
            return "gateway is shutting down"
        if self._mesh.view is None:
            return f"no ready topology: {self._mesh.reason}"
        return f"no ready topology: {self._failure}; waiting for the coordinator to publish a complete one"

    def _publish_ready(self) -> None:
        """Tell listeners about a readiness change. Serialized, so that two threads noticing changes
        at once (the watcher and the scheduler) cannot deliver them out of order."""
        with self._publish_lock:
            with self._lock:
                ready = self._ready_locked()
                if ready == self._ready:
                    return
                self._ready = ready
                listeners = list(self._ready_listeners)
                reason = "" if ready else self._not_ready_reason()
            if ready:
                self._log.info("mesh_ready")
            else:
                self._log.info("mesh_not_ready", reason=reason)
            for callback in listeners:
                callback(ready)

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception:  # a bug must not leave RPCs waiting forever
                self._log.exception("scheduler_error")
                self._fail_everything(Internal("internal scheduler error (see gateway logs)"))
                time.sleep(0.1)

    def _iterate(self) -> bool:
        """One pass: collect finished steps, end and release what must end, admit, keep the pipeline
        full, then sleep until something happens. False: shut down."""
        self._wakeup.clear()  # before looking at anything, so that no wake-up in between is lost
        for step in self._dispatch.completed(time.monotonic()):
            self._complete(step)
        with self._lock:
            state, closing = self._mesh, self._closing
            view = state.view if self._usable_locked() else None
            expired = closing and self._clock() >= self._deadline
            dropped = self._admission.drop(everything=closing)
            late = self._admission.expired(self._clock())
            has_waiting = bool(self._admission)
        for s in dropped:  # waiting for a slot: none to release
            self._end(s, by_client=s.handle.cancelled)
        for s in late:
            what = "resume" if s.resumes else "start"
            self._end_failed(s, Unavailable(f"could not {what} within {self.cfg.resume_timeout:g} s "
                                            f"(--resume-timeout): {s.resume_reason}"))  # fmt: skip
        for s in [s for s in self._running if not s.in_flight and (s.handle.cancelled or expired)]:
            self._end(s, by_client=s.handle.cancelled)
        if view is not None and self._drop_moved(view):
            has_waiting = True  # back in the queue, to resume on `view` now (not after the next wake-up)
        self._release_ended()
        if closing and not self._running and not has_waiting and not self._dispatch.steps:
            return False
        if view is not None and (self._running or has_waiting):
            self._fresh += self._admit(view)
            if self._gathering and not self._dispatch.steps:
                self._gathering = False
                if self._gather(closing):
                    self._fresh += self._admit(view)
            self._fill_pipeline(view, state.seq)
        self._wakeup.wait(self._sleep_for(closing, expired))
        return True

    def _gather(self, closing: bool) -> bool:
        """Before the first step after one that took new requests in, once no step is in flight, while slots are
        free: wait until `admission_window` passes without a new request (at most GATHER_WINDOWS of them), or until
        every free slot has a request waiting for it, so that a burst still arriving is prefilled together. Whether
        any came.

        Why: where the workers' compute threads hold every core (real-time priority on a small host), this
        gateway's threads, and any client beside it, run only between steps. A burst of requests then trickles in
        a few at a time, each few prefilled in a step of its own, and the last ones finish several steps after the
        rest, in steps of a few rows. The cost: a lone request's first decode step starts one window later."""
        window = self.cfg.admission_window
        if window <= 0 or closing:
            return False
        with self._lock:
            if self._free_slots_locked() <= len(self._admission):
                return False
            seen = start = self._arrivals
        began = time.monotonic()
        end, quiet_until = began + window * GATHER_WINDOWS, began + window
        while (now := time.monotonic()) < min(quiet_until, end):
            woken = self._wakeup.wait(min(quiet_until, end) - now)
            if woken:
                self._wakeup.clear()
            with self._lock:
                arrived, full = self._arrivals, self._free_slots_locked() <= len(self._admission)
            if woken and arrived == seen:  # not an arrival (a cancellation, a mesh change, shutdown): look at it now
                self._wakeup.set()
                break
            seen = arrived
            if full:
                break
            if woken:  # an arrival: the burst goes on
                quiet_until = time.monotonic() + window
        return seen != start

    def _sleep_for(self, closing: bool, expired: bool) -> float:
        """Until the shutdown deadline or a step's backstop deadline, at most IDLE_WAIT_S."""
        timeout = IDLE_WAIT_S
        if closing and not expired:
            timeout = min(timeout, max(0.0, self._deadline - self._clock()))
        now = time.monotonic()
        deadline = self._dispatch.next_deadline(now)
        if deadline is not None:
            timeout = min(timeout, deadline - now)
        return timeout

    def _drop_moved(self, view: MeshView) -> bool:
        """Resume the running requests on `view` when the mesh moved to other workers or a new epoch (where the
        stages that kept their caches keep them). Whether any did."""
        held_by = self._running[0].view if self._running else None
        moved = held_by is not None and held_by.placement != view.placement
        if moved:
            self._resume([s for s in self._running if s.view is held_by],
                         f"topology changed to v{view.version} with other workers")  # fmt: skip
        self._dispatch.settle(keep=view)  # the old placement's steps serve nobody now; the new chain waits for them
        return moved

    # -- admission and the pipeline ---------------------------------------------------------------

    def _admit(self, view: MeshView) -> int:
        """Waiting requests into free slots, oldest first. How many began to run."""
        admitted = 0
        if not self._slots.serves(view) and not self._running:
            if self._dispatch.steps:
                return 0  # the old placement's last steps are still out: its slots are not ours to hand out yet
            with self._lock:
                self._slots.adopt(view)
                self._adopt_blocks(view)
        while True:
            with self._lock:
                taken = self._admission.next_admitted(self._slots)
                if taken is None:
                    return admitted
            s, slot = taken
            refusal = context_refusal(s.req, view)
            if refusal is not None:
                with self._lock:
                    self._slots.put_back(slot)
                self._end_failed(s, refusal)
                continue
            hit = self._hold_blocks(s, view)
            if hit is None:  # first come, first served: it waits at the front of the queue for blocks
                with self._lock:
                    self._slots.put_back(slot)
                    self._admission.requeue([s])
                return admitted
            kept = s.kept
            replayed = s.resumed_on(view, slot, lost_stages(kept.view, view) if kept is not None else None)
            if s.replay is None and s.cached < hit:
                s.cached = hit  # a cached prefix: prefilled from there on
            if kept is not None and kept.slot != slot:  # its cache is not taken back: free the old slot there
                self._to_release.append(Vacated.kept_by(s, kept, keeps_key=True))
            s.ready_at = next(self._ready_clock)
            if s.sampling is None:  # once: a resumed sequence keeps its seed
                s.sampling = wire.token_sampling(s.req.sampling, s.prompt_len)
            if s.resume_deadline is not None and not s.resumes:  # arrived while the mesh was changing
                s.resume_deadline = None
                self._log.info("request_waited_for_mesh", request_id=s.req.request_id, trace_id=s.trace_id,
                               waited_ms=round((self._clock() - s.lost_at) * 1000, 3))  # fmt: skip
            if s.resume_deadline is not None:
                s.resume_deadline = None
                waited = self._clock() - s.lost_at
                stages = s.replay.stages if s.replay is not None else None
                self._log.info("request_resuming", request_id=s.req.request_id, trace_id=s.trace_id, slot=slot,
                               version=view.version, replay_tokens=replayed, reason=s.resume_reason,
                               replay_stages=[stages.first, stages.end] if stages else None if s.cached else "all",
                               waited_ms=round(waited * 1000, 3))  # fmt: skip
                if self._obs is not None:
                    self._obs.request_resumed(s.trace, s.resume_reason, replayed, waited)
            if s.trace is not None:
                s.trace.admitted(slot)
            self._running.append(s)
            admitted += 1

    def _adopt_blocks(self, view: MeshView) -> None:
        """The block pool for `view` (under _lock, as a new placement is adopted): the same pool when the blocks
        are the same, with its prefix index forgotten (other workers hold other KV: sequences replay into their
        blocks); a new one when they were resized (every table of the old one is void then)."""
        if view.kv_block_size == 0:
            self._blocks = None
        elif self._blocks is not None and (self._blocks.num_blocks, self._blocks.block_size) == (
            view.kv_blocks, view.kv_block_size):  # fmt: skip
            self._blocks.forget_index()
            self._unshare(self._blocks)
        else:
            self._blocks = BlockPool(view.kv_blocks, view.kv_block_size, self._prefix_counters)

    def _unshare(self, pool: BlockPool) -> None:
        """On a new placement, the resuming sequences that share prefix blocks give their tables up (under _lock):
        each of them would replay its log from position 0 into the shared blocks, several sequences writing one
        block. They take new, private blocks at admission instead, and replay everything on every stage (their
        caches kept elsewhere sit in the old blocks). Sequences with blocks of their own keep them, and replay only
        where their cache was lost."""
        for s in self._admission.waiting():
            if s.block_pool is pool and s.blocks is not None and pool.shares(s.blocks):
                pool.release(s.blocks)
                s.blocks, s.block_pool = None, None
                if s.kept is not None:  # nothing of it is where its new table points
                    s.kept = Kept(s.kept.view, s.kept.slot, 0, None)

    def _hold_blocks(self, s: Sequence, view: MeshView) -> int | None:
        """On a paged mesh, make `s` hold the blocks it may need: those it kept through a resume, or a new table
        with its longest cached prefix and the rest reserved (see `gateway/blocks.py`). Returns the leading
        tokens of its log found cached (0 but for a new table's prefix hit); None when the pool cannot promise
        the blocks yet."""
        pool = self._blocks
        if pool is None or (s.blocks is not None and s.block_pool is pool):
            return 0
        total = min(s.req.max_total_tokens, view.max_context)
        # A penalty counts the tokens the last stage recorded for this sequence: a prefix it skips is not there.
        lookup = self.cfg.prefix_caching and not s.req.sampling.penalized
        with self._lock:
            table = pool.admit(s.log, total, lookup=lookup)
        if table is None:
            return None
        s.blocks, s.block_pool = table, pool
        return table.cached_tokens

    def _fill_pipeline(self, view: MeshView, seq: int) -> None:
        """Dispatch micro-batches while fewer steps than the pipeline depth are in flight."""
        depth = pipeline_depth(self.cfg.pipeline_depth, view.pp)
        while len(self._dispatch.steps) < depth:
            if not self._dispatch.may_start(view):
                return  # a new chain (after a failure or a move) starts once every old step is over
            planned = plan_micro_batch(self._running, depth, view.max_batch_tokens)
            if not planned:
                return
            steps = self._decode_steps(view, planned, depth)
            with self._lock:  # blocks for the positions this step writes, from each sequence's reservation
                for p in planned:
                    if p.seq.blocks is not None and p.seq.block_pool is not None:
                        p.seq.block_pool.grow(p.seq.blocks, p.seq.cached + p.num_tokens + steps - 1)
            self._dispatch.start(view, planned, seq, self._clock(), steps)
            self._gathering, self._fresh = self._gathering or self._fresh > 0, 0

    def _decode_steps(self, view: MeshView, planned: list[Planned[Sequence]], depth: int) -> int:
        """Decode steps the next call runs (worker.proto `StepRequest.decode_steps`): one, or up to
        `cfg.decode_steps` when one step is in flight at a time (a single stage, or stages taking turns: the
        workers feed each drawn token to the next step themselves, the last stage sending it back to the first,
        so no step of the gateway's lies between them), every entry is a sequence decoding on every stage, and
        no request waits for a free slot (it joins the next call, not one `decode_steps` later). A full pipeline
        (depth > 1) keeps one step per call: a stage looping over one micro-batch's tokens would leave the
        others waiting. Never past any entry's last token (`max_new_tokens`) or the context. Tokens a stop
        condition ends early on are computed and dropped: at most decode_steps - 1 steps of one sequence."""
        n = self.cfg.decode_steps
        if n <= 1 or depth != 1:
            return 1
        for p in planned:
            s = p.seq
            if (p.num_tokens != 1 or not p.sample or not s.tokens or s.prefilling
                    or s.entry_stages(view.pp) != (0, 0)):  # fmt: skip
                return 1
            n = min(n, s.req.max_new_tokens - len(s.tokens), view.max_context - s.cached)
        if n > 1:
            with self._lock:
                if self._admission and self._free_slots_locked() > 0:
                    return 1
        return max(n, 1)

    # -- steps that completed ---------------------------------------------------------------------

    def _complete(self, step: StepInFlight) -> None:
        # Entries of sequences that resumed meanwhile belong to a cache that is gone: their answers are dropped
        # (a replay recomputes the same tokens).
        current = [step.current(i) for i in range(len(step.planned))]
        planned = [p for p, ok in zip(step.planned, current, strict=True) if ok]
        for p in step.planned:  # free for the next step; a sequence that ended meanwhile can be released now
            p.seq.in_flight, p.seq.ready_at = False, next(self._ready_clock)
            if p.seq.retired:
                self._to_release.append(Vacated.of(p.seq))
        obs = self._obs
        try:
            response = step.response()
        except ShardFailure as e:
            if obs is not None:
                obs.step_done(step.traced, len(planned), 0, self._clock() - step.started, None, str(e))
            self._on_step_failure(e, step)
            return
        now = self._clock()
        extra = step.decode_steps - 1  # positions each entry wrote past its first in a multi-step call
        tokens = sum(p.num_tokens + extra for p in planned)
        if obs is not None:
            obs.step_done(step.traced, len(planned), tokens, now - step.started, response)
        self._log.debug("step", step_id=step.step_id, entries=len(planned), tokens=tokens,
                        ms=round((now - step.started) * 1000, 3))  # fmt: skip
        with self._lock:
            for p in planned:
                p.seq.cached += p.num_tokens + extra
                if p.seq.blocks is not None and p.seq.block_pool is self._blocks and self._blocks is not None:
                    # Every stage wrote these positions: their full blocks can serve other sequences' prefixes.
                    self._blocks.commit(p.seq.blocks, p.seq.log, p.seq.cached)
        sampled = [(p, ok) for p, ok in zip(step.planned, current, strict=True) if p.sample]
        ended: set[int] = set()  # sequences a token of this call ended: the call's later tokens for them are dropped
        for i in range(step.decode_steps):  # the tokens are step-major
            tokens_i = response.tokens[i * len(sampled) : (i + 1) * len(sampled)]
            for (p, ok), token in zip(sampled, tokens_i, strict=True):
                if ok and not p.seq.retired and id(p.seq) not in ended and self._on_token(p.seq, token, now):
                    ended.add(id(p.seq))

    def _on_step_failure(self, e: ShardFailure, step: StepInFlight) -> None:
        placement = step.view.placement
        with self._lock:
            # A newer version of the same placement is the same processes: it is broken too.
            current = self._mesh.view
            seq = self._mesh.seq if current is not None and current.placement == placement else step.seq
            if seq > self._failed_seq:  # the first failure on this mesh says why it is unusable
                self._failed_seq, self._failure = seq, str(e)
            moved = current is not None and current.placement != placement
        # Every worker of the mesh, for the coordinator to probe: the failing shard may be a survivor that only saw
        # its peer vanish. Not once the mesh moved to other workers: the coordinator knows, the old steps end anyway.
        if self._report_failure is not None and not moved:
            self._report_failure([s.worker_id for s in step.view.shards], str(e))
        self._dispatch.break_chain()
        self._dispatch.settle()  # the other steps on the broken mesh: give them a moment, then cancel
        doomed = [s for s in self._running if s.view is not None and s.view.placement == placement]
        self._log.error("step_failed", step_id=step.step_id, error=str(e), worker=e.shard.address,
                        stage=e.shard.stage, tp_rank=e.shard.tp_rank, request_ids=[s.req.request_id for s in doomed],
                        trace_ids=[s.trace_id for s in doomed])  # fmt: skip
        self._publish_ready()
        self._resume(doomed, str(e))  # their KV cache lived on the broken mesh

    def _resume(self, sequences: list[Sequence], reason: str) -> None:
        """Back to the front of the queue, to replay their token logs on the next complete mesh. Nothing is released
        now: the workers that survive keep their caches, which the sequence takes back on the next mesh when they
        are in it (the same slot); its old slot is released only once it resumes in another one, or ends."""
        resuming = []
        for s in sequences:
            if s.handle.cancelled:  # nobody to resume for: it ends as any cancelled request does
                self._end_cancelled(s, by="client")
                continue
            self._running.remove(s)
            with self._lock:  # free in the pool (no Release): it takes it back first when it resumes on this mesh
                self._slots.release([(s.view, s.slot)] if s.view is not None else [])
            s.resume(self._clock(), self.cfg.resume_timeout, reason)
            resuming.append(s)
        if resuming:
            self._log.warning("requests_resuming", reason=reason, request_ids=[s.req.request_id for s in resuming],
                              trace_ids=[s.trace_id for s in resuming], timeout_s=self.cfg.resume_timeout)  # fmt: skip
            with self._lock:
                self._admission.requeue(resuming)

    def _on_token(self, s: Sequence, token: worker_pb2.SampledToken, now: float) -> bool:
        """Give `s` its next token; whether it ended the sequence."""
        token_id, logprob = token.token_id, token.logprob
        if s.gap_open:  # the first token after a resume: how long the client waited
            s.gap_open = False
            gap = now - (s.token_times[-1] if s.token_times else s.req.arrival)
            self._log.info("request_resumed", request_id=s.req.request_id, trace_id=s.trace_id,
                           gap_ms=round(gap * 1000, 3), resumes=s.resumes)  # fmt: skip
            if self._obs is not None:
                self._obs.resume_gap(gap)
        delta, reason = s.add_token(token_id, logprob, now)
        if s.trace is not None and len(s.tokens) == 1:
            s.trace.first_token()
        summary = None
        if reason is not None:
            summary = s.summary(reason, now)
            self._finish(s, summary)
        top = tuple((t.token_id, t.logprob) for t in token.top_logprobs)
        s.handle.events.put(TokenEvent(len(s.tokens) - 1, int(token_id), float(logprob), delta, summary, top))
        return summary is not None

    # -- endings ----------------------------------------------------------------------------------

    def _retire(self, s: Sequence) -> None:
        """`s` stops running. Its slot goes to the next Release once no step in flight uses it (a
        Release must never race a Step into the same slot); its key is free again after that."""
        if s in self._running:
            self._running.remove(s)
            if not s.in_flight:
                self._to_release.append(Vacated.of(s))
            else:
                s.retired = True
        elif s.view is None:  # waiting for a slot (a first one, or one to resume in)
            if s.kept is not None:  # the slot it had where it was lost (best effort: those workers may be gone)
                self._to_release.append(Vacated.kept_by(s, s.kept, keeps_key=False))
                s.kept = None
                return
            with self._lock:
                self._admission.forget(s.key)

    def _finish(self, s: Sequence, summary: Summary) -> None:
        """Take `s` out of the running set; its slot is released at the next step boundary."""
        self._retire(s)
        if self._obs is not None:
            self._obs.request_finished(s.trace, summary)
        t = summary.timings
        self._log.info("request_finished", request_id=s.req.request_id, trace_id=s.trace_id,
                       finish_reason=summary.finish_reason.value,
                       prompt_tokens=summary.prompt_tokens, completion_tokens=summary.completion_tokens,
                       queue_ms=round(t.queue_ms, 3), time_to_first_token_ms=round(t.time_to_first_token_ms, 3),
                       total_ms=round(t.total_ms, 3))  # fmt: skip

    def _end_cancelled(self, s: Sequence, by: str) -> None:
        delta = s.text.finish()
        summary = s.summary(FinishReason.CANCELLED, self._clock())
        self._log.info("request_cancelled", request_id=s.req.request_id, trace_id=s.trace_id, by=by,
                       completion_tokens=len(s.tokens))  # fmt: skip
        self._finish(s, summary)
        s.handle.events.put(EndEvent(summary=summary, text_delta=delta))

    def _end(self, s: Sequence, by_client: bool) -> None:
        if by_client:
            self._end_cancelled(s, by="client")
        else:
            self._end_by_shutdown(s)

    def _end_by_shutdown(self, s: Sequence) -> None:
        """The gateway stops before `s` finished. With tokens sent, it is cancelled: the client has a partial answer,
        marked CANCELLED. Without any, nothing was generated: it fails UNAVAILABLE, which every client reads as
        "retry elsewhere", rather than ending with zero tokens and a status that reads as success."""
        if s.tokens:
            self._end_cancelled(s, by="shutdown")
            return
        self._log.info("request_not_served", request_id=s.req.request_id, trace_id=s.trace_id, reason="shutdown",
                       admitted=s.view is not None)  # fmt: skip
        self._end_failed(s, Unavailable("the gateway is shutting down: the request was not served (no token was "
                                        "generated); send it again, to another gateway or once this one is "
                                        "back"))  # fmt: skip

    def _end_failed(self, s: Sequence, error: MeshError) -> None:
        self._retire(s)
        if self._obs is not None:
            self._obs.request_failed(s.trace, error)
        s.handle.events.put(EndEvent(error=error))

    def _release_ended(self) -> None:
        """Release every vacated slot on the mesh that held it, then free the slots, and the keys of the
        requests that ended (a resuming one keeps its key)."""
        vacated, self._to_release = self._to_release, []
        by_view: dict[int, tuple[MeshView, list[Vacated]]] = {}
        for v in vacated:
            if v.view is not None:
                by_view.setdefault(id(v.view), (v.view, []))[1].append(v)
        for view, group in by_view.values():
            released = [wire.released_slot(v.key, v.slot) for v in group]
            for failure in view.release(released, self.cfg.release_timeout):
                self._log.warning("release_failed", error=str(failure), request_ids=[v.request_id for v in group],
                                  trace_ids=[v.trace_id for v in group])  # fmt: skip
        with self._lock:
            for v in vacated:
                if not v.keeps_key:
                    self._admission.forget(v.key)
            self._slots.release([(v.view, v.slot) for v in vacated if v.view is not None])
            for v in vacated:
                if v.blocks is not None and v.blocks[0] is self._blocks:  # a pool since replaced holds nothing
                    v.blocks[0].release(v.blocks[1])

    def _fail_everything(self, error: MeshError) -> None:
        with self._lock:
            waiting = self._admission.drain()
        for s in [*waiting, *self._running]:
            self._end_failed(s, error)
        self._dispatch.break_chain()
        with self._lock:
            self._slots.clear()  # rebuilt from kv_slots at the next admission
            self._blocks = None
