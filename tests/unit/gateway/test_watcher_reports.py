"""The watcher turns a worker's vanished health watch into a failure report naming the worker of the current
topology at that address (the coordinator then probes it), so an idle gateway reports a dead worker too."""

from __future__ import annotations

from gateway.watcher import TopologyWatcher
from shardmesh.core.topology import WorkerState
from tests.unit.cli.fake_coordinator import topology, worker
from tests.unit.gateway.fakes import LogLines


def test_a_vanished_worker_is_reported_by_id() -> None:
    watcher = TopologyWatcher("127.0.0.1:1", logger=LogLines().logger)
    reports: list[tuple[list[str], str]] = []
    try:
        watcher._worker_lost("127.0.0.1:5001", "UNAVAILABLE")  # no topology yet, nobody to report to: nothing
        watcher.report_failure = lambda ids, why: reports.append((ids, why))
        watcher._apply(topology(*(worker(i, WorkerState.SERVING, i) for i in range(4))))
        watcher._worker_lost("127.0.0.1:5001", "UNAVAILABLE: Socket closed")
        watcher._worker_lost("127.0.0.1:5999", "UNAVAILABLE")  # not in the topology: not ours to report
    finally:
        watcher.stop()
    assert reports == [(["worker-1"], "health watch on 127.0.0.1:5001: UNAVAILABLE: Socket closed")]
