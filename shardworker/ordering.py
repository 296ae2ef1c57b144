"""Steps run in the order the gateway dispatched them, whatever order their RPCs arrive in.

With pipelining the gateway keeps several steps in flight, and two Step RPCs sent one after the other
may reach a worker in either order. But every shard must run the same steps in the same order:
activations between stages (Gloo send/recv) and the collectives inside a stage are matched by order,
not by step. So the gateway chains its steps: each `StepRequest` names the step that must finish on
this shard before it runs (`after_step_id`; 0 starts a chain and runs at once), and `StepOrder`
holds a step back until its predecessor has had its turn here.

Nothing waits forever. A predecessor that has not *arrived* within `arrival_timeout_s` fails the
step (the gateway never sent it here, or it was lost); one that arrived is waited for as long as it
takes, since it is either running (bounded by its own link and collective timeouts) or waiting for
its own predecessor (bounded the same way). A predecessor that gives up its turn without running
fails its waiting successor at once. A new rendezvous epoch gets a new `StepOrder`; closing the old
one fails whatever still waits on it.

Step ids are only compared for equality: a restarted gateway numbers its steps from 1 again, and its
first step (`after_step_id` 0) simply starts a new chain.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

POLL_S = 0.25  # how often a waiting step looks at its RPC's cancellation (nothing notifies it)
REMEMBERED = 256  # recent steps that gave up their turn, kept so that their successors fail at once


class OrderError(Exception):
    """A step that cannot get its turn; the message names `after_step_id`."""


class StepOrder:
    """The turn-taking of one rendezvous epoch's steps on one shard."""

    def __init__(self, arrival_timeout_s: float = 10.0) -> None:
        self.arrival_timeout_s = arrival_timeout_s
        self._cv = threading.Condition()
        self._last = 0  # the step that finished its turn most recently (0: none yet)
        self._arrived: set[int] = set()  # arrived, turn not over yet (waiting or running)
        # (step id, when) of steps that gave up before their turn; a waiter only heeds those that gave
        # up after it arrived (an older one with the same id belongs to an earlier chain).
        self._abandoned: deque[tuple[int, float]] = deque(maxlen=REMEMBERED)
        self._closed = ""  # why nothing can run here any more

    @contextlib.contextmanager
    def turn(self, step_id: int, after_step_id: int, cancelled: Callable[[], bool] | None = None) -> Iterator[float]:
        """Hold the step until `after_step_id` has finished its turn here; yields the seconds waited.
        The turn ends (and the successor may go) when the block exits, whether the step ran or failed."""
        t0 = time.perf_counter()
        with self._cv:
            self._arrived.add(step_id)
            self._cv.notify_all()  # a successor may be timing out on our arrival
            try:
                self._wait(after_step_id, cancelled or (lambda: False), time.monotonic())
            except OrderError:
                self._arrived.discard(step_id)
                self._abandoned.append((step_id, time.monotonic()))
                self._cv.notify_all()
                raise
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cv:
                self._arrived.discard(step_id)
                self._last = step_id
                self._cv.notify_all()

    def close(self, reason: str) -> None:
        """Fail every step still waiting here, and every later one: `reason` says why."""
        with self._cv:
            self._closed = reason
            self._cv.notify_all()

    def waiting(self) -> int:
        """Steps that arrived and have not finished their turn (for tests and introspection)."""
        with self._cv:
            return len(self._arrived)

    def _wait(self, after: int, cancelled: Callable[[], bool], arrived_at: float) -> None:
        """Called with the lock held; returns when `after` is the last step to have finished here."""
        if after == 0:
            return
        deadline = arrived_at + self.arrival_timeout_s
        while self._last != after:
            if self._closed:
                raise OrderError(f"after_step_id: step {after} will not run here: {self._closed}")
            if any(step == after and when >= arrived_at for step, when in self._abandoned):
                raise OrderError(f"after_step_id: step {after} gave up its turn here without running")
            if cancelled():
                raise OrderError(f"after_step_id: cancelled while waiting for step {after}")
            remaining = deadline - time.monotonic()
            if after not in self._arrived and remaining <= 0:
                raise OrderError(f"after_step_id: step {after} did not arrive within {self.arrival_timeout_s:g} s "
                                 f"(last step run here: {self._last or 'none'})")  # fmt: skip
            self._cv.wait(POLL_S if after in self._arrived else min(POLL_S, max(remaining, 0.001)))
