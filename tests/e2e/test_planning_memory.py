"""The memory model against real stage workers: predicted bytes vs the resident memory they really hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.worker_memory import measure_runtime, measure_workers
from shardmesh.core.topology import ServingLimits
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.planning.memory import load_model, shard_memory

# 12 layers of 64 MiB plus a 32 MiB embedding and a 32 MiB head in float32: 832 MiB, so each of two
# stages holds ~416 MiB of weights (more than the ~260 MiB a worker process costs) and 48 MiB of KV cache.
BIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 12,
       "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8192,
       "max_position_embeddings": 256}  # fmt: skip
LIMITS = ServingLimits(kv_slots=4, max_context=256, max_batch_tokens=256)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("big") / "model", BIG)  # sparse: written in milliseconds


def test_estimates_match_measured_workers_within_10_percent(big_model: Path, tmp_path: Path) -> None:
    # The process's fixed cost is measured here first, as `bench.worker_memory` does for a
    # deployment: part of it is page-cache dependent (torch's shared libraries), so a constant measured
    # on another installation can be ~60 MiB off. Everything else comes from the model alone.
    (tmp_path / "calibrate").mkdir()
    runtime, _ = measure_runtime(tmp_path / "calibrate")
    model = load_model(big_model)
    measured = measure_workers(big_model, pp=2, tp=1, limits=LIMITS, log_dir=tmp_path)
    assert [m.layers for m in measured] == [(0, 6), (6, 12)]
    for m in measured:
        est = shard_memory(model, m.layers, 1, m.tp_rank, "float32", LIMITS, runtime)
        assert est.weights > 400 * 2**20 and est.weights > est.runtime  # weights dominate
        # The peak (VmHWM) is loading's; after one full step of 256 tokens the worker holds `serving`.
        assert abs(m.peak / est.total - 1) < 0.10, (m, est)
        assert abs(m.current / est.serving - 1) < 0.10, (m, est)
