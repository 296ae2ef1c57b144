"""A paged KV cache from the command line: `up` hands --kv-block-size and --kv-cache-memory to the coordinator,
`generate` runs with blocks and draws the tokens it draws with a slot, and `status` says blocks instead of slots."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardmesh.core.topology import ServingLimits, WorkerState
from shardmesh_cli import status, up
from shardmesh_cli.main import main
from tests.checkpoints import make_checkpoint, reference_greedy
from tests.unit.cli.fake_coordinator import topology, worker
from tests.unit.cli.test_up_spares import Spawned, _up_args, spawned  # noqa: F401  (spawned: a fixture)


def test_up_passes_the_kv_cache_flags_to_the_coordinator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawned: Spawned  # noqa: F811
) -> None:  # fmt: skip
    monkeypatch.setattr(up, "wait_serving", lambda *a, **k: None)
    mesh = up.start_mesh(_up_args("--kv-block-size", "16", "--kv-cache-memory", "2GiB", log_dir=tmp_path), Path("/m"))
    coordinator = mesh.commands["coordinator"][0]
    assert coordinator[coordinator.index("--kv-block-size") + 1] == "16"
    assert coordinator[coordinator.index("--kv-cache-memory") + 1] == "2GiB"
    mesh.stop()
    mesh = up.start_mesh(_up_args(log_dir=tmp_path), Path("/m"))  # the slot cache: neither flag
    assert not {"--kv-block-size", "--kv-cache-memory"} & set(mesh.commands["coordinator"][0])
    mesh.stop()


def test_status_shows_blocks_for_a_paged_cache() -> None:
    mesh = topology(worker(0, WorkerState.SERVING, 0))
    assert "4 KV slots × 256 tokens, 256 tokens per step" in status.render(mesh)
    paged = replace(mesh, limits=ServingLimits(4, 256, 256, kv_block_size=16, kv_blocks=100))
    text = status.render(paged)
    assert "100 KV blocks × 16 tokens (4 sequences, 256 tokens each at most), 256 tokens per step" in text
    assert "KV slots" not in text
    assert status.as_json(paged)["limits"] == {"kv_slots": 4, "max_context": 256, "max_batch_tokens": 256,
                                               "kv_block_size": 16, "kv_blocks": 100}  # fmt: skip


def test_generate_with_blocks_draws_the_reference_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_checkpoint(tmp_path / "m", "llama-gqa-tied", num_layers=4, seed=5, eos_token_id=95)
    prompt = [1, 17, 5, 42, 9, 3]
    argv = ["generate", "--model", str(model), "--pp", "2", "--token-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", "7", "--json", "--kv-block-size", "4"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == reference_greedy(model, prompt, 7)[0]
    assert main([*argv[:-1], "-3"]) == 2
    assert "--kv-block-size: must be >= 0 (0: one slot), got -3" in capsys.readouterr().err
