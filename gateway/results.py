"""What the scheduler tells a waiting RPC: one event per generated token, then the end.

The scheduler thread produces events and the RPC's own thread consumes them from a queue
(`RequestHandle.events`), so a slow client never stalls a step. The stream contract of
`GenerateStreamResponse` ("every message carries exactly one token; the last one also carries the
summary") maps directly: a `TokenEvent` with `summary` set is the last message. An `EndEvent` ends
a request that has no token left to carry the ending: a failure, or a cancellation.
"""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from shardmesh.core.errors import MeshError


class FinishReason(enum.Enum):
    """Why a request ended; the value is what logs, metrics and spans say (`shardmesh.finish_reason`)."""

    LENGTH = "length"  # max_new_tokens reached
    EOS = "eos"  # the model's end-of-sequence token (not with ignore_eos)
    STOP_STRING = "stop_string"  # a stop string in the text
    STOP_TOKEN = "stop_token"  # one of the request's stop token ids
    CANCELLED = "cancelled"  # the client went away, or the server shut down

    @property
    def openai(self) -> str:
        """OpenAI's name (the GenAI conventions' too): "stop" for every way a sequence ends by itself, "length"."""
        return "stop" if self in (FinishReason.EOS, FinishReason.STOP_STRING, FinishReason.STOP_TOKEN) else self.value


@dataclass(frozen=True)
class Timings:
    """Milliseconds, measured by the gateway from the RPC's arrival (see gateway.proto's Timings)."""

    queue_ms: float
    time_to_first_token_ms: float
    inter_token_ms: tuple[float, ...]
    total_ms: float

    @property
    def mean_inter_token_ms(self) -> float:
        return sum(self.inter_token_ms) / len(self.inter_token_ms) if self.inter_token_ms else 0.0


@dataclass(frozen=True)
class Summary:
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `summary` is set on the request's last token only. `top_logprobs`: the most likely
    tokens at its position as (token id, log-probability), most likely first, when the request asked."""

    index: int
    token_id: int
    logprob: float
    text_delta: str
    summary: Summary | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class EndEvent:
    """The end of a request not carried by a token: `error` for a failure, else `summary` (a
    cancellation; any text still held back is in `text_delta`)."""

    summary: Summary | None = None
    error: MeshError | None = None
    text_delta: str = ""


Event = TokenEvent | EndEvent


def is_last(event: Event) -> bool:
    return isinstance(event, EndEvent) or event.summary is not None


class RequestHandle:
    """The RPC's side of a submitted request: read `events` until `is_last`; `cancel()` from any
    thread (a gRPC termination callback) and the scheduler drops the request at its next step
    boundary, releasing its KV slot on every shard."""

    def __init__(self, request_id: str, on_cancel: Callable[[], None]) -> None:
        self.request_id = request_id
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._on_cancel = on_cancel

    def cancel(self) -> None:
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
