"""bench/cpu_paths.py: which paths it runs on which CPU, and that a child times the path the environment picks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.cpu_paths import child, paths
from shardmesh.engine import cpu_kernels
from shardmesh.engine.cpu_kernels import ISA_ENV
from shardmesh.engine.linear import KERNEL_ENV
from tests.checkpoints import make_checkpoint


def test_paths_per_dtype_and_cpu() -> None:
    assert paths("float32", ["avx2", "fma", "f16c"]) == {"compiled": {}, "eager": {KERNEL_ENV: "onednn-packed"}}
    assert paths("bfloat16", ["avx2", "avx512f"]) == {"compiled": {}, "eager": {KERNEL_ENV: "input-major"},
                                                      "avx2": {ISA_ENV: "avx2"}}  # fmt: skip


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"no C++ build: {cpu_kernels.build_error()}")
def test_a_child_times_the_path_its_environment_picks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_checkpoint(tmp_path, "llama-gqa-tied", num_layers=2, seed=1)
    threads = torch.get_num_threads()
    try:
        compiled = child(str(d), "float32", [1, 3], prompt=12, steps=2)
        monkeypatch.setenv(KERNEL_ENV, "onednn-packed" if torch.backends.mkldnn.is_available() else "input-major")
        eager = child(str(d), "float32", [1, 3], prompt=12, steps=2)
    finally:
        torch.set_num_threads(threads)
    assert compiled["kernels"] == ["cpu-blocked"] and compiled["runner"] == "compiled"
    assert eager["kernels"] != ["cpu-blocked"] and eager["runner"] == "eager"
    for got in (compiled, eager):
        assert set(got) == {"kernels", "runner", "decode 1", "decode 3", "prefill 12"}
        assert all(got[k] > 0 for k in ("decode 1", "decode 3", "prefill 12"))
