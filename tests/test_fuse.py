"""Stacked products (shardmesh/engine/fuse.py) compute what the separate ones did, with and without tensor
parallelism and biases; and every tensor operation of a worker runs on its one compute thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import structlog
import torch

from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import dense
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import BatchLayout, Segment
from shardworker.runtime import StageWorkerCore, StepRefused
from tests.checkpoints import make_checkpoint


def _products(model: torch.nn.Module) -> int:
    return sum(1 for m in model.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)
               and m.weight.dim() == 2 and "Embedding" not in type(m).__name__)  # fmt: skip


@pytest.mark.parametrize(("family", "tp"), [("qwen2-bias-tied", 1), ("llama-mha-untied", 2)])
def test_fused_products_match_the_separate_ones(tmp_path: Path, family: str, tp: int) -> None:
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=5)
    ids = torch.tensor([1, 7, 3, 9, 2])
    batch = BatchLayout.build([Segment(0, 0, len(ids))])
    for rank in range(tp):  # each rank's share alone: the head and embedding are vocab-split, the rest by heads
        outs, counts, layers = [], [], []
        for fuse in (False, True):
            spec = ShardSpec(0, 1, 2, rank, tp)  # the first layer: hidden states out
            m = build_shard(d, spec, UnboundGroup(rank, tp), progress=False, fuse=fuse)
            layer = next(iter(m.model.layers.values()))
            assert (layer.self_attn.qkv_proj is not None) is fuse
            counts.append(_products(m))
            layers.append(layer)
            if tp == 1:  # (tp > 1 all-reduces: tests/test_equivalence.py runs fused tp meshes against transformers)
                outs.append(m(ids, batch, m.make_cache(1, torch.float32, "cpu")))
        assert counts[1] == counts[0] - 3  # q/k/v -> 1 and gate/up -> 1 in the one layer
        sep, fused = layers
        a = sep.self_attn  # the stacked matrices hold this rank's own slices, in order
        stacked = torch.cat([dense(p.weight) for p in (a.q_proj, a.k_proj, a.v_proj)])
        assert torch.equal(dense(fused.self_attn.qkv_proj.weight), stacked)
        assert torch.equal(dense(fused.mlp.gate_up_proj.weight),
                           torch.cat([dense(sep.mlp.gate_proj.weight), dense(sep.mlp.up_proj.weight)]))  # fmt: skip
        if a.q_proj.bias is not None:
            assert torch.equal(fused.self_attn.qkv_proj.bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        if outs:
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_worker_core_runs_tensor_work_on_one_thread() -> None:
    """gRPC calls a core from many handler threads; a second OpenMP team would slow every step (service.py)."""
    core = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()))
    try:
        with ThreadPoolExecutor(4) as callers:
            seen = set(callers.map(lambda _: core._on_compute(threading.get_ident), range(16)))
        assert len(seen) == 1 and threading.get_ident() not in seen
        assert core._on_compute(torch.get_num_threads) == torch.get_num_threads()
        with pytest.raises(ZeroDivisionError):  # errors reach the caller
            core._on_compute(lambda: 1 / 0)
    finally:
        core.close()


def test_a_step_waiting_for_the_lock_leaves_the_compute_thread_free() -> None:
    """`apply` holds the core's lock while a load runs on the compute thread: a step arriving meanwhile
    must wait for the lock on its own thread, not on the compute thread (that would deadlock the load)."""
    core = StageWorkerCore("w", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()))
    refused: list[StepRefused] = []

    def step() -> None:
        try:
            core.step(1, [])
        except StepRefused as e:  # no shard yet: refused once it gets the lock
            refused.append(e)

    try:
        with core._lock:
            caller = threading.Thread(target=step)
            caller.start()
            time.sleep(0.2)  # the step is waiting for the lock now
            assert core._compute.submit(lambda: 42).result(timeout=5) == 42  # what a load would need
        caller.join(5)
        assert not caller.is_alive() and refused and refused[0].kind == "not_ready"
    finally:
        core.close()
