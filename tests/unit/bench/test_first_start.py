"""bench/first_start.py: the time to ready read from `shardmesh up`'s line, each kernel's build from the workers'
logs, and the table's ratio taken within each round."""

from __future__ import annotations

import json
from pathlib import Path

from bench import first_start


def test_the_ready_line_gives_the_time_and_the_logs() -> None:
    line = ("gateway listening on 127.0.0.1:1, coordinator on 127.0.0.1:2, OpenAI-compatible API at "
            "http://127.0.0.1:3/v1 (ready in 63.2 s; logs in /tmp/shardmesh-up-x)")  # fmt: skip
    found = first_start.READY.search(line)
    assert found is not None and found.groups() == ("63.2", "/tmp/shardmesh-up-x")


def test_each_kernels_build_is_the_longest_a_worker_logged(tmp_path: Path) -> None:
    (tmp_path / "worker0.log").write_text("\n".join([
        json.dumps({"event": "kernel_built", "kernel": "shardmesh_cpu", "seconds": 30.2}),
        "not json",
        json.dumps({"event": "ready", "seconds": 51.5}),
    ]))  # fmt: skip
    (tmp_path / "worker1.log").write_text(json.dumps({"event": "kernel_built", "kernel": "shardmesh_cpu",
                                                      "seconds": 48.7}))  # fmt: skip
    (tmp_path / "gateway.log").write_text(json.dumps({"event": "kernel_built", "kernel": "other", "seconds": 1}))
    assert first_start.kernel_builds(tmp_path) == {"shardmesh_cpu": 48.7}


def test_the_ratio_is_taken_within_each_round() -> None:
    runs = {"this": [{"ready_s": 60.0, "kernels": {"k": 30.0}}, {"ready_s": 80.0, "kernels": {}}],
            "rev": [{"ready_s": 100.0, "kernels": {"k": 50.0}}, {"ready_s": 100.0, "kernels": {}}]}  # fmt: skip
    md, data = first_start.report({"date": "2026-11-30", "cpu": "c", "cpu_id": "i", "cores": 2, "torch": "t"},
                                  "0123456789abcdef", 2, runs)  # fmt: skip
    assert data["ratio"] == 0.7  # rounds 0.6 and 0.8
    assert "| this | 70.0 | 60.0 / 80.0 | k 30.0 |" in md and "| 0123456789 | 100.0 |" in md
    assert "**0.70×**" in md
