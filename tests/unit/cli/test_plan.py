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
    given = ["--link-bandwidth", "12GB/s"]  # cpu workers: given, so no probe of this host
    assert main(["plan", "--model", model, "--devices", "2x24GiB", *given]) == 1
    err = capsys.readouterr().err
    assert "does not fit on node0:2x24GiB" in err and "missing" in err and "more 24GiB devices" in err
    assert main(["plan", "--model", model, "--devices", "2x24GiB", "--json", *given]) == 1
    assert json.loads(capsys.readouterr().out)["missing_bytes"] > 0
    for argv, msg in (
        (["--devices", "4x"], "--devices: expected [NODE:]COUNTxSIZE"),
        (["--devices", "4x80GiB", "--max-context", "100000"], "--max-context: must be in 1..8192"),
        (["--devices", "4x80GiB", "--tp", "3"], "tensor degree 3 is not valid"),
        (["--devices", "2x24GiB", "--link-bandwidth", "fast"], "--link-bandwidth: expected a rate like 25GB/s"),
        (
            ["--devices", "2x24GiB", "--device", "cuda", "--memory-bandwidth", "3TB/s"],
            "--memory-bandwidth: give --link-bandwidth too",
        ),
    ):
        assert main(["plan", "--model", model, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {msg}") and "Traceback" not in err and err.count("\n") == 1, err


def test_plan_command_offload_with_a_given_link(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama-3-70B in float32 on two 64 GiB cpu hosts: offload copies the bfloat16 checkpoint's streamed layers into
    float32 buffers; the step time is the streamed bytes over the rates given, and the output says they were given."""
    model = str(CONFIGS / "llama-3-70b")
    argv = ["plan", "--model", model, "--devices", "2x64GiB", "--link-bandwidth", "10GB/s",
            "--memory-bandwidth", "20GB/s"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "offload in float32 (--memory-budget" in err and ", copy)" in err
    assert "link 10.00 GB/s (given: --link-bandwidth); memory 20.00 GB/s (given: --memory-bandwidth)" in err
    assert main([*argv, "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    offload = next(o["offload"] for o in got["options"] if "offload" in o)
    assert offload["rates"]["link"] == {"bytes_per_s": 10e9, "source": "given: --link-bandwidth"}
    streamed, read = offload["streamed_bytes_per_step"], offload["read_bytes_per_step"]
    assert streamed > 0 and offload["step_seconds"] == pytest.approx(streamed / 10e9 + read / 20e9)
    assert all(s["total"] + s["headroom"] == s["device_memory"] and s["headroom"] >= 0 for s in offload["shards"])
    assert sum(s["streamed_layers"][1] - s["streamed_layers"][0] for s in offload["shards"][:1]) * 855_638_016 * 4 == (
        streamed * offload["tp"]
    )  # float32 products of the streamed layers, a tp-th each per rank


def test_plan_sizes_a_paged_kv_cache_from_the_memory_left(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kv-block-size`: as many blocks as the tightest device has room for, and no more (one more block would not
    fit it); `--kv-cache-memory`: what that size buys at the most loaded shard's cost per block."""
    model = str(CONFIGS / "llama-3-70b")
    base = ["plan", "--model", model, "--devices", "4x80GiB", "--dtype", "bfloat16", "--device", "cuda"]
    assert main([*base, "--json", "--kv-block-size", "16", "--reserve", "1GiB"]) == 0
    got = json.loads(capsys.readouterr().out)
    blocks = got["limits"]["kv_blocks"]
    # Llama-3-70B at tp=4: 80 layers × 2 kv heads of 128 × 16 tokens × 2 bytes × {k, v}; no log (one stage).
    per_block = 80 * 2 * 2 * 128 * 16 * 2
    assert got["limits"]["kv_block_size"] == 16
    tightest = min(s["headroom"] for s in got["shards"])
    assert 1024**3 <= tightest < 1024**3 + per_block  # filled to the reserve, within one block
    assert all(s["kv_cache"] == blocks * per_block for s in got["shards"])
    assert main([*base, "--kv-block-size", "16", "--kv-cache-memory", "10GiB"]) == 0
    table = capsys.readouterr().out
    assert f"paged KV cache: {10 * 1024**3 // per_block} blocks × 16 tokens" in table
    assert main([*base, "--kv-cache-memory", "10GiB"]) == 2
    assert "--kv-cache-memory: sizes a paged KV cache, give --kv-block-size too" in capsys.readouterr().err
