"""`shardmesh plan`: the table and JSON of a plan, and exit codes with one-line errors for what does not fit or
cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardmesh_cli.main import main

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def test_plan_command_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(CONFIGS / "llama-3-70b")
    assert main(["plan", "--model", model, "--devices", "4x80GiB", "--dtype", "bfloat16", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "plan: tp=4 × pp=1 on 4 of 4 devices" in out and "weights 131.42 GiB, KV cache 20.00 GiB" in out
    assert out.count("[0, 80)") == 4 and "headroom" in out
    argv = ["plan", "--model", model, "--devices", "nodeA:2x80GiB,nodeB:1x48GiB", "--dtype", "bfloat16",
            "--max-context", "4096", "--kv-slots", "4", "--device", "cuda", "--json"]  # fmt: skip
    assert main(argv) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tp"] == 1 and got["pp"] == 3 and [s["node"] for s in got["shards"]] == ["nodeA", "nodeA", "nodeB"]
    assert sum(e - s for s, e in got["layer_split"]) == 80 and got["limits"]["max_context"] == 4096
    assert all(s["total"] + s["headroom"] == s["device_memory"] for s in got["shards"])


def test_plan_command_infeasible_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(CONFIGS / "llama-3-70b")
    assert main(["plan", "--model", model, "--devices", "2x24GiB"]) == 1
    err = capsys.readouterr().err
    assert "does not fit on node0:2x24GiB" in err and "missing" in err and "more 24GiB devices" in err
    assert main(["plan", "--model", model, "--devices", "2x24GiB", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["missing_bytes"] > 0
    for argv, msg in (
        (["--devices", "4x"], "--devices: expected [NODE:]COUNTxSIZE"),
        (["--devices", "4x80GiB", "--max-context", "100000"], "--max-context: must be in 1..8192"),
        (["--devices", "4x80GiB", "--tp", "3"], "tensor degree 3 is not valid"),
    ):
        assert main(["plan", "--model", model, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {msg}") and "Traceback" not in err and err.count("\n") == 1, err
