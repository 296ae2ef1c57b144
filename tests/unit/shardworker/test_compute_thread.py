"""Every tensor operation of a worker runs on its one compute thread, and waiting for the core's lock never
blocks that thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import structlog
import torch

from shardmesh.core.errors import FailedPrecondition
from shardmesh.engine import compute_priority
from shardworker.runtime import StageWorkerCore


def test_worker_core_runs_tensor_work_on_one_thread() -> None:
    """gRPC calls a core from many handler threads; a second OpenMP team would slow every step (service.py)."""
    core = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()))
    try:
        with ThreadPoolExecutor(4) as callers:
            seen = set(callers.map(lambda _: core._on_compute(threading.get_ident), range(16)))
        assert len(seen) == 1 and threading.get_ident() not in seen
        assert core._on_compute(torch.get_num_threads) == torch.get_num_threads()
        with pytest.raises(ZeroDivisionError):  # errors reach the caller
            core._on_compute(lambda: 1 / 0)
    finally:
        core.close()


def test_a_step_waiting_for_the_lock_leaves_the_compute_thread_free() -> None:
    """`apply` holds the core's lock while a load runs on the compute thread: a step arriving meanwhile
    must wait for the lock on its own thread, not on the compute thread (that would deadlock the load)."""
    core = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()))
    refused: list[FailedPrecondition] = []

    def step() -> None:
        try:
            core.step(1, [])
        except FailedPrecondition as e:  # no shard yet: refused once it gets the lock
            refused.append(e)

    try:
        with core._lock:
            caller = threading.Thread(target=step)
            caller.start()
            time.sleep(0.2)  # the step is waiting for the lock now
            assert core._compute.submit(lambda: 42).result(timeout=5) == 42  # what a load would need
        caller.join(5)
        assert not caller.is_alive() and refused and refused[0].code == "FAILED_PRECONDITION"
    finally:
        core.close()


def test_the_compute_thread_takes_the_priority_it_is_given() -> None:
    """`--compute-priority realtime` is set on the compute thread before its first tensor operation, so the OpenMP
    team that operation makes inherits it (tests/unit/engine/test_compute_priority.py); other threads stay normal."""
    allowed = compute_priority.refusal() is None
    core = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()),
                           priority="realtime")  # fmt: skip
    try:
        assert core._on_compute(compute_priority.current) == ("realtime" if allowed else "normal")
        assert compute_priority.current() == "normal"
    finally:
        core.close()
    with pytest.raises(ValueError, match="must be one of normal, realtime"):
        StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()), priority="max")
