"""Micro-batch planning: which sequences' tokens go into the next step. Pure: state in, plan out.

With P steps in flight at once (the pipeline depth), the running set is split into P disjoint
micro-batches: a sequence is in at most one step in flight, since its next input is the token its last
step sampled. A micro-batch takes at most ceil(running / P) sequences, so the running set splits into P
of them (new requests join whichever has room), and at most `max_batch_tokens` tokens:

  1. decode rows first, one token each, longest-waiting first;
  2. then prompt entries, longest-waiting first, each the whole rest of its prompt or a chunk of what is
     left of the budget. Only a prompt's last chunk samples a token; earlier chunks only fill the cache.
     A sequence resuming after a lost worker prefills its log the same way (`prefill_len`), and its last
     chunk samples nothing: the next token is known, its decode step comes next. A replay on some stages
     only ends its chunks where that replay ends (`chunk_end`): the entries after it go to every stage.

"Longest-waiting" is `ready_at`: a counter stamped when a sequence last became free for a step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Schedulable(Protocol):
    """What the planner reads of a running sequence."""

    @property
    def prefill_len(self) -> int: ...  # tokens to cache before decoding: the prompt (+ a replayed log)
    @property
    def samples_after_prefill(self) -> bool: ...  # whether the last prefill chunk draws a token
    @property
    def chunk_end(self) -> int: ...  # where the next prefill chunk ends at the latest (a replay on some stages)
    @property
    def cached(self) -> int: ...  # tokens already in its KV cache
    @property
    def ready_at(self) -> int: ...  # when it last became free for a step: smaller waited longer
    @property
    def in_flight(self) -> bool: ...  # part of a step in flight: not plannable until it completes


S = TypeVar("S", bound=Schedulable)


@dataclass(frozen=True)
class Planned(Generic[S]):
    """One entry of a micro-batch: `num_tokens` of `seq`'s log from its `cached` position on."""

    seq: S
    num_tokens: int
    sample: bool  # False for a prompt chunk that is not the prompt's last


def pipeline_depth(configured: int, pp: int) -> int:
    """Steps in flight at once: as configured, or (0) one per pipeline stage."""
    return configured or pp


def plan_micro_batch(running: Iterable[S], depth: int, max_batch_tokens: int) -> list[Planned[S]]:
    """The next micro-batch from `running` (every sequence holding a slot, in flight or not), for a
    pipeline `depth` steps deep; empty when no sequence is free or the budget has no room."""
    running = list(running)
    free = sorted((s for s in running if not s.in_flight), key=lambda s: s.ready_at)
    cap = -(-len(running) // depth)  # ceil(running / depth)
    budget = max_batch_tokens
    planned: list[Planned[S]] = []
    for s in free:
        if len(planned) >= min(cap, budget):
            break
        if s.cached >= s.prefill_len:
            planned.append(Planned(s, 1, True))
    budget -= len(planned)
    for s in free:
        if len(planned) >= cap or budget <= 0:
            break
        if s.cached < s.prefill_len:
            n = min(s.chunk_end - s.cached, budget)
            planned.append(Planned(s, n, s.cached + n == s.prefill_len and s.samples_after_prefill))
            budget -= n
    return planned
