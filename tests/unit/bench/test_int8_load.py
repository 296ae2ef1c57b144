"""bench/int8_load.py: its table (each way's median, the ratio within each round), its baseline load that turns the
one-pass quantizer off, and its count of groups whose numbers differ between the two quantizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import int8_load
from shardmesh.engine import cpu_kernels
from tests.checkpoints import make_checkpoint


def test_the_table_sets_the_one_pass_load_against_the_float64_one_of_the_same_round() -> None:
    rounds = [{"one pass": 2.0, "float64 tensors": 10.0, "float32": 1.0},
              {"one pass": 3.0, "float64 tensors": 10.0, "float32": 2.0}]  # fmt: skip
    md, data = int8_load.report({"date": "2026-11-30", "cpu": "c", "cpu_id": "i", "cores": 2, "torch": "t"}, "m",
                                rounds, {"matrices": 3, "groups": 40, "differing": 0})  # fmt: skip
    assert data["ratio"] == 0.25  # rounds 0.2 and 0.3
    assert "| one pass | 2.50 | 2.00 / 3.00 |" in md and "**0.25×**" in md
    assert "Quantizing beyond the float32 load: 1.00 s against 8.50 s." in md
    assert "0 of 40 groups differ (3 matrices)" in md


@pytest.mark.skipif(not cpu_kernels.available(), reason="the kernels need a C++ compiler")
def test_the_baseline_load_quantizes_through_float64_tensors_to_the_same_groups(tmp_path: Path, monkeypatch) -> None:
    from shardmesh.engine import linear

    model = make_checkpoint(tmp_path / "m", "llama-mha-untied", num_layers=2)
    check = int8_load.differing_groups(str(model))
    assert check["matrices"] > 0 and check["groups"] > 0 and check["differing"] == 0
    calls: list[str] = []
    monkeypatch.setattr(cpu_kernels, "quantize_groups", lambda w, g: calls.append("one pass") or (w, w))
    monkeypatch.setattr(linear, "ONE_PASS_DTYPES", linear.ONE_PASS_DTYPES)  # restored after the child's change
    got = int8_load.child(str(model), "float64 tensors")
    assert calls == [] and got["seconds"] > 0 and json.dumps(got)
