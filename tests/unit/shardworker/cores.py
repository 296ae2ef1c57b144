"""Real stage cores in this process, driven the way a mesh drives them: every core at once, each in its own thread
(forming groups and running a pipelined step need all of them), errors re-raised in the test's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from shardmesh.core.step import StepEntry
from shardmesh.core.topology import ShardState, Topology
from shardworker.runtime import StageWorkerCore, StepResult
from tests.waiting import WAIT_S


def new_store(port: int = 0) -> dist.TCPStore:
    """The rendezvous store, as a coordinator serves it."""
    return dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def new_core(worker_id: str) -> StageWorkerCore:
    return StageWorkerCore(worker_id, torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()), 30.0)


def on_every_core(cores: list[StageWorkerCore], fn: Callable[[StageWorkerCore], Any],
                  raising: bool = True) -> list[Any]:  # fmt: skip
    """`fn(core)` for every core at once, each in its own thread; the results in core order (an exception one raised
    is raised here, or with `raising` False, returned in its place)."""
    results: list[Any] = [None] * len(cores)

    def run(i: int) -> None:
        try:
            results[i] = fn(cores[i])
        except BaseException as e:  # re-raised below, in the test's thread
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not any(t.is_alive() for t in threads), "a core did not return"
    for r in results:
        if isinstance(r, BaseException) and raising:
            raise r
    return results


def apply_all(cores: list[StageWorkerCore], topology: Topology) -> None:
    """Every core applies `topology` at once (forming groups needs all of them)."""
    on_every_core(cores, lambda core: core.apply(topology))
    assert all(core.state is ShardState.READY for core in cores), [core.detail for core in cores]


def run_step(cores: list[StageWorkerCore], version: int, entries: list[StepEntry]) -> list[StepResult]:
    """One step of `entries` on every core at once; the results in stage order."""
    results = on_every_core(cores, lambda core: core.step(version, entries))
    assert all(isinstance(r, StepResult) for r in results), results
    return results
