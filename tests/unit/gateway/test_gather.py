"""The admission window (`SchedulerConfig.admission_window`, `Scheduler._gather`): after a step that took new requests
in, the next step waits for more arrivals while slots are free, so that a burst trickling in between steps is
prefilled together; it stops waiting once every free slot is spoken for, and at once for anything else that needs
the loop (here, shutdown)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.results import RequestHandle, TokenEvent
from gateway.scheduler import Scheduler, SchedulerConfig
from gateway.watcher import ModelFiles
from tests.unit.gateway.fakes import FakeMesh, collect, mesh_state, request, started, tokens
from tests.waiting import WAIT_S


def entries(mesh: FakeMesh) -> list[list[str]]:
    """The request ids of each step's entries, on the first shard."""
    return [[e.request_id for e in step.entries] for step in mesh.shards[0].steps]


@contextmanager
def gathering(logger: Any, model_files: ModelFiles) -> Iterator[tuple[Scheduler, FakeMesh, RequestHandle]]:
    """A scheduler with a window longer than any wait here, over a mesh of 2 slots, and request "a" whose prompt step
    is over: the scheduler is gathering arrivals for the next step when this yields."""
    cfg = SchedulerConfig(max_queue=8, step_timeout=5.0, decode_steps=4, admission_window=3 * WAIT_S)
    with started(cfg, logger) as scheduler:
        mesh = FakeMesh(pp=1, tp=1, kv_slots=2)
        scheduler.update_mesh(mesh_state(mesh, model_files))
        a = scheduler.submit(request(model_files, "a", "hi", max_new=6))
        assert isinstance(a.events.get(timeout=WAIT_S), TokenEvent)  # its first token: the prompt step is over
        yield scheduler, mesh, a


def test_a_request_arriving_after_a_prompt_step_joins_the_next_step(logger: Any, model_files: ModelFiles) -> None:
    with gathering(logger, model_files) as (scheduler, mesh, a):
        b = scheduler.submit(request(model_files, "b", "hi", max_new=6))
        # the gathering ends because the last free slot is spoken for, not because its window passed
        assert len(tokens(collect(a))) == 5 and len(tokens(collect(b))) == 6
    assert entries(mesh)[:2] == [["a"], ["a", "b"]]  # b's prompt came with a's first decode step, not after it


def test_shutdown_ends_a_gathering_at_once(logger: Any, model_files: ModelFiles) -> None:
    with gathering(logger, model_files) as (scheduler, mesh, a):
        done = threading.Event()
        threading.Thread(target=lambda: (scheduler.shutdown(grace=WAIT_S), done.set()), daemon=True).start()
        # a finishes within the grace: the gathering gave way to the shutdown instead of holding its step back
        assert len(tokens(collect(a))) == 5 and done.wait(WAIT_S)
    assert entries(mesh)[:2] == [["a"], ["a"]]
