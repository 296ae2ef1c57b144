"""`shardmesh top` for a worker that streams layers (a memory budget): bytes streamed per token, the achieved read
rate, the bound measured at load and their ratio, from the metrics as the worker exports them."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from shardmesh.core.topology import ShardState, WorkerState
from shardmesh.engine.offload import StreamStats
from shardmesh_cli import top
from shardworker.metrics import WorkerMetrics
from tests.unit.cli.fake_coordinator import topology, worker

PLAN = 3 * 1_179_648  # bytes streamed per step
BOUND = 12e9  # bytes per second, measured at load


def _scrape(tokens: int, steps: int, read_s: float, wait_s: float, stream: bool = True) -> top.Metrics:
    """A worker's /metrics after `steps` one-token steps of 50 ms, each streaming `PLAN` bytes."""
    stats = StreamStats(steps * PLAN, steps * PLAN, read_s, wait_s, BOUND, PLAN, True) if stream else None
    info = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
            "state": ShardState.READY, "bytes_streamed": steps * PLAN if stream else 0, "offload": stats}  # fmt: skip
    metrics = WorkerMetrics(lambda: info, lambda: "w0", "cpu")
    metrics.step_tokens.inc(tokens)
    for _ in range(steps):
        metrics.step_seconds.observe(0.05)
    return top.Metrics.parse(generate_latest(metrics.registry).decode())


def _frame(prev: dict[str, top.Metrics], cur: dict[str, top.Metrics]) -> list[str]:
    mesh = topology(worker(0, WorkerState.SERVING, 0), worker(1, WorkerState.SERVING, 1))
    before = top.Snapshot(0.0, 0.0, topology=mesh, workers=dict(prev))
    after = top.Snapshot(2.0, 2.0, topology=mesh, workers=dict(cur))
    return top.render(after, before, "127.0.0.1:50051", None).splitlines()


def _offload_table(lines: list[str]) -> list[list[str]]:
    """The OFFLOAD table's header and rows, cell by cell (columns are two or more spaces apart)."""
    at = next(i for i, line in enumerate(lines) if line.startswith("OFFLOAD"))
    end = next(i for i in range(at, len(lines)) if lines[i].startswith("STREAMED/TOKEN:"))  # the legend
    return [re.split(r"\s{2,}", line) for line in lines[at:end]]


def test_a_streaming_worker_shows_bytes_per_token_the_achieved_rate_and_the_bound() -> None:
    # In the window: 40 one-token steps of 50 ms, their reads 0.02 s (40 x PLAN / 0.02 s = 7.1 GB/s), 0.2 s waited.
    prev = {"worker-0": _scrape(10, 10, 0.01, 0.05), "worker-1": _scrape(10, 10, 0, 0, stream=False)}
    cur = {"worker-0": _scrape(50, 50, 0.03, 0.25), "worker-1": _scrape(50, 50, 0, 0, stream=False)}
    header, *rows = _offload_table(_frame(prev, cur))
    assert header == ["OFFLOAD", "STREAMED/TOKEN", "PLAN/STEP", "ACHIEVED", "BOUND", "ACHIEVED/BOUND", "WAIT"]
    achieved = 40 * PLAN / 0.02
    want = ["worker-0", top.human_bytes(PLAN), top.human_bytes(PLAN), f"{achieved / 1e9:.1f} GB/s", "12.0 GB/s",
            f"{achieved / BOUND:.2f}", "10%"]  # fmt: skip
    assert rows == [want]  # worker-1 streams nothing: no row


def test_an_idle_window_shows_the_numbers_since_start_in_parentheses() -> None:
    scrape = _scrape(8, 4, 0.05, 0.1)  # 4 steps of 2 tokens each
    _, row = _offload_table(_frame({"worker-0": scrape}, {"worker-0": scrape}))
    achieved = 4 * PLAN / 0.05
    want = ["worker-0", f"({top.human_bytes(PLAN / 2)})", top.human_bytes(PLAN), f"({achieved / 1e9:.1f} GB/s)",
            "12.0 GB/s", f"({achieved / BOUND:.2f})", "(50%)"]  # fmt: skip
    assert row == want  # waited 0.1 s of 4 x 50 ms


def test_no_offload_section_when_no_worker_streams() -> None:
    plain = {"worker-0": _scrape(4, 4, 0, 0, stream=False)}
    assert not any(line.startswith("OFFLOAD") for line in _frame(plain, plain))
