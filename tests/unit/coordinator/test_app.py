"""`shardmesh coordinator`'s flags: everything wrong is found before anything listens, and said in one line
naming the flag, with exit code 2 (in process, and through a real process for the balance flags)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardmesh_cli import main as cli

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 128,
}  # fmt: skip


def _model_dir(tmp_path: Path, **config: object) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({**TINY_CONFIG, **config}))
    return tmp_path / "model"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return _model_dir(tmp_path)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--tp", "3"], {}, "--tp: tensor parallel degree 3 must divide num_attention_heads=4"),
        (["--pp", "5"], {}, "--pp: cannot split 4 layers over 5 stages"),
        ([], {"SHARDMESH_COORDINATOR_PP": "5"}, "--pp: cannot split 4 layers over 5 stages"),
        (["--heartbeat-interval", "1", "--heartbeat-timeout", "0.5"], {}, "--heartbeat-timeout: must exceed"),
        (["--max-context", "4096"], {}, "--max-context: must be in 1..128"),
        (["--listen", "127.0.0.1"], {}, "--listen: expected host:port"),
        (
            ["--tp", "2", "--tp-split", "2,1,1"],
            {},
            "--tp-split: tp split 2,1,1 has 3 shares for tensor parallel degree 2",
        ),
        (
            ["--tp", "2", "--tp-split", "3,2"],
            {},
            "--tp-split: tp split 3,2: its shares add up to 5, which must divide intermediate_size=64",
        ),
        (["--tp", "2", "--tp-split", "2,x"], {}, "--tp-split: tp split '2,x': expected whole numbers and commas"),
        (["--tp", "2", "--tp-split", "2,0"], {}, "--tp-split: tp split '2,0': every share must be at least 1"),
        (
            [],
            {"SHARDMESH_COORDINATOR_TP_SPLIT": "3,1"},
            "--tp-split: tp split 3,1 has 2 shares for tensor parallel degree 1",
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    model_dir: Path, flags: list[str], env: dict[str, str], message: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["coordinator", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["coordinator", "--model", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith("error: --model:")


def test_coordinator_refuses_bad_balance_flags(tmp_path: Path) -> None:
    ten_layers = _model_dir(tmp_path, num_hidden_layers=10)
    cases = ((["--layers", "4,1"], "--layers: need 2 counts >= 1 (one per stage) adding up to the model's 10 layers, "
                                   "got '4,1'"),
             (["--max-stage-ratio", "0.5"], "--max-stage-ratio: must be >= 1.0, got 0.5"),
             (["--rank-nodes", "a"], "--rank-nodes: need 2 node names (one per rank), got 'a'"))  # fmt: skip
    for flags, message in cases:
        r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "coordinator", "--model", str(ten_layers), "--pp",
                            "2", *flags], capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and r.stderr.strip() == f"error: {message}", r.stderr


def _limits(model_dir: Path, *flags: str) -> object:
    from coordinator.app import build_config

    return build_config(cli.build_parser().parse_args(["coordinator", "--model", str(model_dir), *flags])).limits


def test_a_paged_cache_gets_the_blocks_its_memory_buys_on_the_most_loaded_shard(model_dir: Path) -> None:
    from shardmesh.core.topology import ServingLimits

    assert _limits(model_dir) == ServingLimits(8, 128, 128)  # no --kv-block-size: slots, as before
    # pp=2 with layers 3 + 1, tp=2 (one of the 2 kv heads each), head_dim 8, float32, blocks of 16 tokens. Stage 0,
    # the most loaded: keys and values 2 × 3 layers × 1 × 8 × 16 × 4 B = 3072 B, and its activation log 16 × 32 × 4
    # = 2048 B, 5120 B a block; stage 1 (last, one layer: 1024 B) has as many blocks. 1 MiB buys 204 of them.
    layout = ["--pp", "2", "--tp", "2", "--layers", "3,1", "--kv-block-size", "16"]
    assert _limits(model_dir, *layout, "--kv-cache-memory", "1MiB") == ServingLimits(8, 128, 128, 16, 204)
    # Without --kv-cache-memory: what the slot cache holds, 8 slots × 128 tokens in blocks of 16.
    assert _limits(model_dir, *layout) == ServingLimits(8, 128, 128, 16, 64)
    assert _limits(model_dir, *layout, "--kv-slots", "1", "--max-context", "100") == ServingLimits(1, 100, 100, 16, 7)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-cache-memory", "1GiB"], "--kv-cache-memory: sizes a paged KV cache, give --kv-block-size too"),
        (["--kv-block-size", "-1"], "--kv-block-size: must be >= 0 (0: a slot per sequence), got -1"),
        (["--kv-block-size", "16", "--kv-cache-memory", "lots"], "--kv-cache-memory: expected a size like 24GiB"),
        # pp=1, tp=1: 2 × 4 layers × 2 kv heads × 8 × 16 × 4 B = 8192 B a block (the last stage keeps no log)
        (["--kv-block-size", "16", "--kv-cache-memory", "20KiB"],
         "--kv-cache-memory: 20480 bytes buy 2 blocks of 16 tokens at 8192 bytes each (the most loaded shard's), "
         "fewer than one sequence of max_context 128 needs: 8 blocks, 65536 bytes"),
    ],
)  # fmt: skip
def test_bad_kv_cache_flags_exit_2_naming_the_flag(
    model_dir: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    assert cli.main(["coordinator", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
