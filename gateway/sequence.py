"""A running sequence: one request as the scheduler drives it, from the queue to its release.

Its token log is the prompt followed by the generated ids (`req.prompt_ids` + `tokens`); `cached` says
how much of the log the workers' KV slot holds, so the next input is always the log from `cached` on
(a prompt chunk while prefilling, the last sampled token after). When a worker holding its cache is
lost (or the mesh moves), `resume` notes where its cache was (`Kept`) and the sequence waits for a mesh
again. There it takes the same slot back when the stages that kept their caches allow it
(`gateway/retention.py`) and replays the cached part of its log on the other stages only (`Replay`);
otherwise it prefills its whole log but the last token on every stage. Either way nothing is sampled
during a replay (those tokens were sent to the client already), and then it decodes on from the last
token as if nothing had happened. The stop conditions are checked here,
token by token: an end-of-sequence id, a stop token id, a stop string in the text, or `max_new_tokens`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.requests import PreparedRequest
from gateway.results import FinishReason, RequestHandle, Summary, Timings
from gateway.retention import StageRange
from gateway.text import CompletionText

if TYPE_CHECKING:
    from gateway.blocks import BlockPool, BlockTable
    from gateway.fanout import MeshView
    from gateway.observe import RequestTrace
    from shardmesh.proto.v1 import worker_pb2


@dataclass(frozen=True)
class Kept:
    """Where a resuming sequence's cache was: `cached` positions in `slot` of `view`'s workers, all of them but
    the stages of `short` (a replay interrupted there: they hold less)."""

    view: MeshView
    slot: int
    cached: int
    short: StageRange | None = None


@dataclass(frozen=True)
class Replay:
    """Positions [0, until) go through `stages` only: the other stages still hold them."""

    stages: StageRange
    until: int


@dataclass(eq=False)
class Sequence:
    """The scheduler's record of one request (owned by the scheduler thread once admitted)."""

    req: PreparedRequest
    handle: RequestHandle
    key: str  # the request id the workers see; unique among requests in flight
    trace: RequestTrace | None = None  # its spans, when tracing is on
    trace_id: str = ""  # for log lines written outside the request's own thread
    text: CompletionText = field(init=False)
    slot: int = -1
    view: MeshView | None = None  # the mesh holding its KV cache, once admitted
    cached: int = 0  # tokens of the log in the KV cache: prompt chunks, then each decoded input
    tokens: list[int] = field(default_factory=list)  # the generated part of the log
    logprobs: list[float] = field(default_factory=list)
    first_step_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    in_flight: bool = False  # part of a step in flight (one at most: its next input is what that step samples)
    retired: bool = False  # ended while its step was in flight: released when that step completes
    ready_at: int = 0  # when it last became free for a step (a counter): the longest-waiting go first
    sampling: worker_pb2.TokenSampling | None = None  # built at its first admission, sent with each of its entries
    resumes: int = 0  # times its cache was lost and rebuilt by replaying its log
    resume_deadline: float | None = None  # while waiting to resume: when it gives up (clock of the scheduler)
    resume_reason: str = ""  # why it is waiting to resume
    lost_at: float = 0.0  # when its cache was last lost (clock of the scheduler)
    gap_open: bool = False  # resumed, and no token sent since: the next one closes the pause the client saw
    kept: Kept | None = None  # while waiting to resume: where its cache was
    replay: Replay | None = None  # resumed on a mesh where some stages kept its cache
    # On a paged mesh: its KV blocks, in `block_pool`; kept through a resume (it replays into them) and released
    # when it ends. A table from another pool (the mesh's blocks were resized) is void.
    blocks: BlockTable | None = None
    block_pool: BlockPool | None = None

    def __post_init__(self) -> None:
        self.text = CompletionText(self.req.tokenizer, self.req.stop)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def log(self) -> tuple[int, ...]:
        """The token log: the prompt, then the generated ids."""
        return (*self.req.prompt_ids, *self.tokens)

    @property
    def prefill_len(self) -> int:
        """Log tokens to put in the cache before decoding: the prompt, and after a resume every generated
        token but the last (which the next decode step feeds)."""
        return self.prompt_len + max(0, len(self.tokens) - 1)

    @property
    def samples_after_prefill(self) -> bool:
        """Whether the last prefill chunk draws a token: the prompt's does; a replay's does not, since the
        token after it is known."""
        return not self.tokens

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prefill_len

    @property
    def chunk_end(self) -> int:
        """Where the next prefill chunk must end at the latest: a replay on some stages stops at its end."""
        replay = self.replay
        return replay.until if replay is not None and self.cached < replay.until else self.prefill_len

    def entry_stages(self, pp: int) -> tuple[int, int]:
        """(first_stage, end_stage) of its next entry: (0, 0), every stage, unless replaying on some."""
        replay = self.replay
        return replay.stages.entry_fields(pp) if replay is not None and self.cached < replay.until else (0, 0)

    def inputs(self, num_tokens: int) -> tuple[int, ...]:
        """Log positions [cached, cached + num_tokens): a prompt (or replay) chunk, or the last sampled token
        (while decoding, `cached` is one short of the log: the last token has been sampled, not yet fed)."""
        if self.prefilling:
            return self.log[self.cached : self.cached + num_tokens]
        return (self.tokens[-1],)

    def resume(self, now: float, timeout: float, reason: str) -> None:
        """Workers holding its KV cache are gone, or the mesh moved: wait (until `now + timeout`) for a mesh,
        then replay the log where the cache did not survive (`resumed_on`)."""
        if self.view is not None and self.slot >= 0:
            replay, short = self.replay, None
            if replay is not None and self.cached < replay.until:  # a replay cut short: those stages hold less
                short = replay.stages
            cached = max(self.cached, replay.until) if replay is not None else self.cached
            self.kept = Kept(self.view, self.slot, cached, short)
        self.slot, self.view, self.cached, self.replay = -1, None, 0, None
        self.resumes += 1
        self.lost_at, self.resume_deadline, self.resume_reason = now, now + timeout, reason
        self.gap_open = True

    def resumed_on(self, view: MeshView, slot: int, lost: StageRange | None) -> int:
        """Admitted again, in `slot` of `view`; `lost`: the stages of `view` that no longer hold its cache (see
        `gateway/retention.py`), when that slot is the one it had. Returns the tokens it replays."""
        kept, self.kept = self.kept, None
        self.slot, self.view, self.cached, self.replay = slot, view, 0, None
        if kept is None or kept.slot != slot:
            return kept.cached if kept is not None else 0  # everything it had cached, on every stage
        if lost is None and kept.short is None:
            self.cached = kept.cached  # every stage kept it: nothing to replay
            return 0
        stages = lost.union(kept.short) if lost is not None else kept.short
        assert stages is not None
        until = kept.cached
        if stages.end < view.pp and self.samples_after_prefill:  # the prompt's last token must reach the sampler
            until = min(until, self.prefill_len - 1)
        if until > 0:
            self.replay = Replay(stages, until)
        return until

    def wait_for_mesh(self, now: float, timeout: float, reason: str) -> None:
        """A new request that arrived while the mesh was changing: it waits (until `now + timeout`) like one
        that resumes, with nothing to replay."""
        self.lost_at, self.resume_deadline, self.resume_reason = now, now + timeout, reason

    def add_token(self, token_id: int, logprob: float, now: float) -> tuple[str, FinishReason | None]:
        """Append a sampled token; returns the text now safe to send and why generation ends with this
        token (None: it goes on), checked in this order: an end-of-sequence id (EOS; none with ignore_eos),
        one of the request's stop token ids (STOP_TOKEN), a stop string in the text (STOP_STRING),
        `max_new_tokens` (LENGTH). A token that ends it by its id adds no text (as in vLLM); on an ending
        the text held back is flushed into the delta."""
        self.tokens.append(int(token_id))
        self.logprobs.append(float(logprob))
        self.token_times.append(now)
        reason: FinishReason | None = None
        if token_id in self.req.eos_token_ids:
            reason = FinishReason.EOS
        elif token_id in self.req.stop_token_ids:
            reason = FinishReason.STOP_TOKEN
        delta = self.text.add(token_id) if reason is None else ""
        if reason is None and self.text.stopped:
            reason = FinishReason.STOP_STRING
        elif reason is None and len(self.tokens) >= self.req.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            delta += self.text.finish()
        return delta, reason

    def summary(self, reason: FinishReason, now: float) -> Summary:
        """Usage and timings, in milliseconds from the RPC's arrival; `now` stands in for the times it
        never reached (no step yet, no token yet)."""
        arrival = self.req.arrival
        times = self.token_times
        timings = Timings(
            queue_ms=((self.first_step_at if self.first_step_at is not None else now) - arrival) * 1000,
            time_to_first_token_ms=(times[0] - arrival) * 1000 if times else 0.0,
            inter_token_ms=tuple((b - a) * 1000 for a, b in itertools.pairwise(times)),
            total_ms=((times[-1] if times else now) - arrival) * 1000,
        )
        return Summary(reason, self.prompt_len, len(self.tokens), timings)
