"""bench/cold_calls.py end to end at a tiny size (two real processes over a shared-memory link), its table against
the warm baseline, and its refusal of arguments it cannot measure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.cold_calls import markdown

ROOT = Path(__file__).resolve().parents[3]


def test_each_condition_is_set_against_the_warm_calls_of_the_same_run() -> None:
    import argparse

    got = {
        "conditions": ["busy 0 ms", "busy 4 ms"],
        "times_us": {"busy 0 ms": {"copy": [2.0, 2.0, 4.0], "send": [5.0, 6.0, 7.0]},
                     "busy 4 ms": {"copy": [20.0, 30.0, 40.0], "send": [60.0, 60.0, 90.0]}},
        "huge_kib": 4096,
        "link": "shm (4 x 256 KiB slots)",
    }  # fmt: skip
    md = markdown({"date": "2026-11-30", "cpu": "cpu", "cores": 2, "torch": "t"},
                  argparse.Namespace(spin_recv=False, rounds=1, pairs=3), got)  # fmt: skip
    rows = {line.split(" | ")[0][2:]: line for line in md.splitlines() if line.startswith("| busy")}
    assert "| 1.0× |" in rows["busy 0 ms"]
    assert "| 15.0× |" in rows["busy 4 ms"] and "| 10.0× |" in rows["busy 4 ms"]  # 30 / 2 and 60 / 6
    assert "4 MiB of huge pages" in md


def test_a_tiny_run_measures_every_condition(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "bench/cold_calls.py", "--gaps-ms", "0,0.1", "--read-mb", "4", "--pairs", "3",
                        "--rounds", "2", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    (data,) = tmp_path.glob("*-cold-calls.json")
    got = json.loads(data.read_text())
    assert got["conditions"] == ["busy 0 ms", "busy 0.1 ms", "sleep 0.1 ms", "read 4 MB, 4 KiB pages",
                                 "read 4 MB, huge pages"]  # fmt: skip
    for c in got["conditions"]:
        assert len(got["times_us"][c]["copy"]) == len(got["times_us"][c]["send"]) == 6
        assert all(t > 0 for t in got["times_us"][c]["send"])


def test_the_gaps_must_start_with_the_warm_baseline(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "bench/cold_calls.py", "--gaps-ms", "1,4", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "--gaps-ms" in r.stderr and "warm baseline" in r.stderr
