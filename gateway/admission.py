"""Admission: the queue of requests waiting for a KV slot, and their admission into slots.

A request is queued when it arrives (refused with RESOURCE_EXHAUSTED when `max_queue` requests would
still be waiting after the next step boundary) and admitted at a step boundary while a slot is free,
oldest first. Each gets a key, the request id the workers see: the client's id, made unique among
requests in flight (`id#2`, ...) because workers keep state by it. A key is free again once its slot
has been released. Not thread-safe: the scheduler's lock guards it.
"""

from __future__ import annotations

from collections import deque

from gateway.fanout import MeshView
from gateway.observe import RequestTrace
from gateway.requests import PreparedRequest
from gateway.results import RequestHandle
from gateway.sequence import Sequence
from gateway.slots import SlotPool
from shardmesh.core.errors import InvalidArgument, ResourceExhausted


class Admission:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._waiting: deque[Sequence] = deque()
        self._keys: set[str] = set()  # of every request queued or holding a slot

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[Sequence]:
        """The waiting sequences, oldest first (a copy)."""
        return list(self._waiting)

    def queued(self, free_slots: int) -> int:
        """Requests still without a slot after the next step boundary: cancelled ones are dropped there,
        and the `free_slots` (counting those that cancelled running requests free there) take waiting ones."""
        waiting = sum(1 for s in self._waiting if not s.handle.cancelled)
        return max(0, waiting - free_slots)

    def enqueue(self, req: PreparedRequest, handle: RequestHandle, free_slots: int, trace: RequestTrace | None,
                trace_id: str) -> Sequence:  # fmt: skip
        queued = self.queued(free_slots)
        if queued >= self.max_queue:
            raise ResourceExhausted(f"queue full: {queued} requests waiting for a KV slot (--max-queue)")
        key, n = req.request_id, 1
        while key in self._keys:  # the same client id twice in flight: workers key state by it
            n += 1
            key = f"{req.request_id}#{n}"
        self._keys.add(key)
        s = Sequence(req, handle, key, trace=trace, trace_id=trace_id)
        self._waiting.append(s)
        return s

    def drop(self, everything: bool) -> list[Sequence]:
        """Take out the cancelled waiting requests (`everything`: all of them, at shutdown)."""
        dropped = [s for s in self._waiting if s.handle.cancelled or everything]
        if dropped:
            self._waiting = deque(s for s in self._waiting if not (s.handle.cancelled or everything))
        return dropped

    def next_admitted(self, slots: SlotPool) -> tuple[Sequence, int] | None:
        """The oldest waiting request with the lowest free slot (a resuming one: its old slot if free, where
        workers may have kept its cache), or None when either is missing."""
        if not slots or not self._waiting:
            return None
        s = self._waiting.popleft()
        return s, slots.take(s.kept.slot if s.kept is not None else None)

    def requeue(self, resuming: list[Sequence]) -> None:
        """Sequences whose workers were lost go back to the front of the queue, in their order, keeping
        their keys: they are admitted again before any request that has not started."""
        self._waiting.extendleft(reversed(resuming))

    def expired(self, now: float) -> list[Sequence]:
        """Take out the sequences waiting to resume whose deadline has passed."""
        late = [s for s in self._waiting if s.resume_deadline is not None and now >= s.resume_deadline]
        if late:
            self._waiting = deque(s for s in self._waiting if s not in late)
        return late

    def drain(self) -> list[Sequence]:
        """Every waiting request, taken out of the queue."""
        waiting, self._waiting = list(self._waiting), deque()
        return waiting

    def forget(self, key: str) -> None:
        """`key` names no request in flight any more."""
        self._keys.discard(key)


def context_refusal(req: PreparedRequest, view: MeshView) -> InvalidArgument | None:
    """Why `req` cannot run on `view` although it was valid when it arrived: the limits changed while it waited."""
    if req.max_total_tokens <= view.max_context:
        return None
    limit = f"prompt + max_new_tokens ({req.max_total_tokens}) exceeds the context of {view.max_context}"
    return InvalidArgument("params.max_new_tokens", limit)
