"""A running sequence: one request as the scheduler drives it, from the queue to its release.

Its token log is the prompt followed by the generated ids (`req.prompt_ids` + `tokens`); `cached` says
how much of the log the workers' KV slot holds, so the next input is always the log from `cached` on
(a prompt chunk while prefilling, the last sampled token after). The stop conditions are checked here,
token by token: a stop string in the text, an end-of-sequence id, or `max_new_tokens`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.requests import PreparedRequest
from gateway.results import FinishReason, RequestHandle, Summary, Timings
from gateway.text import CompletionText

if TYPE_CHECKING:
    from gateway.fanout import MeshView
    from gateway.observe import RequestTrace
    from shardmesh.proto.v1 import worker_pb2


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
    sampling: worker_pb2.TokenSampling | None = None  # built once at admission, sent with each of its entries

    def __post_init__(self) -> None:
        self.text = CompletionText(self.req.tokenizer, self.req.stop)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len

    def inputs(self, num_tokens: int) -> tuple[int, ...]:
        """Log positions [cached, cached + num_tokens): a prompt chunk, or the last sampled token (while
        decoding, `cached` is one short of the log: the last token has been sampled, not yet fed)."""
        if self.prefilling:
            return self.req.prompt_ids[self.cached : self.cached + num_tokens]
        return (self.tokens[-1],)

    def add_token(self, token_id: int, logprob: float, now: float) -> tuple[str, FinishReason | None]:
        """Append a sampled token; returns the text now safe to send and why generation ends with this
        token (None: it goes on). A stop string or an end-of-sequence id is STOP, `max_new_tokens` LENGTH;
        on an ending the text held back is flushed into the delta."""
        self.tokens.append(int(token_id))
        self.logprobs.append(float(logprob))
        self.token_times.append(now)
        delta = self.text.add(token_id)
        if self.text.stopped or token_id in self.req.eos_token_ids:
            reason: FinishReason | None = FinishReason.STOP
        elif len(self.tokens) >= self.req.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
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
