"""The compute thread's scheduling priority (`shardmesh.engine.compute_priority`): what the OS says, what the thread
gets, and that the OpenMP team it makes afterwards gets it too, which is the point of setting it there."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from shardmesh.engine import compute_priority


def _tasks() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _on_a_new_thread(priority: str) -> dict:
    """On a thread of its own: apply `priority`, then run a parallel torch op (libgomp makes that thread's team
    then), and report the policies of the thread and of the threads that appeared meanwhile."""
    seen: dict = {}

    def body() -> None:
        before = _tasks()
        try:
            compute_priority.apply(priority)
        except OSError as e:
            seen["error"] = e
            return
        torch.set_num_threads(2)
        torch.ones(1 << 20).mul_(2).sum()  # large enough for at::parallel_for to start its team
        seen["self"] = compute_priority.current()
        seen["team"] = {tid: os.sched_getscheduler(tid) for tid in _tasks() - before - {threading.get_native_id()}}

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return seen


def test_a_realtime_thread_hands_its_priority_to_the_openmp_team_it_makes() -> None:
    why = compute_priority.refusal()
    seen = _on_a_new_thread("realtime")
    if why is None:  # root, CAP_SYS_NICE or `ulimit -r`: the thread and its team are real-time
        assert seen["self"] == "realtime"
        assert seen["team"], "the parallel op made no OpenMP thread"
        assert set(seen["team"].values()) == {os.SCHED_RR}
    else:  # the OS refuses: apply raises what refusal reported
        assert isinstance(seen["error"], PermissionError)
        assert "CAP_SYS_NICE" in why
    assert compute_priority.current() == "normal"  # the calling thread is left alone either way


def test_normal_changes_nothing() -> None:
    seen = _on_a_new_thread("normal")
    assert seen["self"] == "normal"
    assert all(policy not in (os.SCHED_RR, os.SCHED_FIFO) for policy in seen["team"].values())


def test_a_refusal_names_what_would_allow_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert compute_priority.refusal() == "Operation not permitted (needs CAP_SYS_NICE or `ulimit -r` >= 1)"


def test_unknown_priorities_are_refused() -> None:
    with pytest.raises(ValueError, match="must be one of normal, realtime, got 'high'"):
        compute_priority.apply("high")
