"""The planner's memory model as the registry's check before a re-plan: a mesh that fits passes, one whose
devices are too small is refused with the stage, its layers and what the devices hold."""

from __future__ import annotations

from pathlib import Path

from coordinator.replan import planner_check
from shardmesh.core.config import ModelConfig
from shardmesh.core.topology import ModelSpec, ServingLimits
from tests.checkpoints import make_checkpoint


def test_planner_check_passes_what_fits_and_names_the_stage_that_does_not(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=4, seed=1)
    cfg = ModelConfig.from_dir(path)
    model = ModelSpec(str(path), "float32", cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.vocab_size,
                      cfg.max_context)  # fmt: skip
    check = planner_check(model, ServingLimits(4, 128, 128), tp=1)
    assert check(1, ((0, 4),), [64 * 2**30], ["cpu"]) == ""
    assert check(2, ((0, 2), (2, 4)), [0, 0], ["cpu", "cpu"]) == ""  # memory not known: nothing to check
    why = check(2, ((0, 2), (2, 4)), [64 * 2**30, 1 << 20], ["cpu", "cpu"])
    assert why.startswith("at pp=2, stage 1 needs layers 2-3") and "hold 0" in why
