"""The memory model is exact where it can be: weights and KV cache equal what `build_shard` holds, published
parameter counts come out right, and every term follows its formula."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardmesh.core.heads import valid_tp_degrees
from shardmesh.core.layout import ShardSpec, split_layers
from shardmesh.core.step import CPU_ROW_CHUNK
from shardmesh.core.topology import ServingLimits
from shardmesh.engine.kv_cache import ActivationLog
from shardmesh.engine.loader import build_shard
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.models.checkpoint import CheckpointError
from shardmesh.planning.devices import parse_devices
from shardmesh.planning.memory import RuntimeCosts, load_model, shard_memory
from shardmesh.planning.planner import PlanOptions, plan

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
GiB = 2**30


def _llama(**over: object) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 5,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
           "max_position_embeddings": 64}  # fmt: skip
    return {**cfg, **over}


FAMILIES = {
    "gqa-tied": _llama(tie_word_embeddings=True),
    "mha-untied-odd-vocab": _llama(num_key_value_heads=4, vocab_size=97),  # tp=2, 4 cannot split 97 evenly
    "kv-replicated": _llama(num_key_value_heads=1, head_dim=24),  # tp > kv heads: each rank holds a copy
    "qwen2-bias": {**_llama(tie_word_embeddings=True), "architectures": ["Qwen2ForCausalLM"]},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_and_kv_equal_what_build_shard_holds(family: str, tmp_path: Path) -> None:
    """Exact, for every shard of every (pp, tp): the meta-model count is what a real load holds."""
    model_dir = write_checkpoint(tmp_path / family, FAMILIES[family])
    model = load_model(model_dir)
    limits = ServingLimits(kv_slots=3, max_context=40, max_batch_tokens=16)
    for dtype in ("float32", "bfloat16"):
        for pp in (1, 2, 3):
            for tp in [d for d in valid_tp_degrees(model.cfg) if d <= 4]:
                for start, end in split_layers(model.cfg.num_layers, pp):
                    for rank in range(tp):
                        shard = build_shard(model_dir, ShardSpec(start, end, 5, rank, tp), dtype=getattr(torch, dtype),
                                            max_len=limits.max_context, progress=False)  # fmt: skip
                        held = sum(p.numel() * p.element_size() for p in shard.parameters())
                        cache = shard.make_cache(limits.kv_slots, getattr(torch, dtype), "cpu")
                        log = ActivationLog(limits.kv_slots, limits.max_context, model.cfg.hidden_size,
                                            getattr(torch, dtype))  # fmt: skip
                        kv = cache.nbytes + (0 if shard.is_last else log.nbytes)
                        est = shard_memory(model, (start, end), tp, rank, dtype, limits)
                        assert (est.weights, est.kv_cache) == (held, kv), (family, dtype, pp, tp, rank)
                        assert est.buffers == sum(t.numel() * 4 for t in (shard.rope_cos, shard.rope_sin))


@pytest.mark.parametrize("family", FAMILIES)
def test_uneven_shares_are_counted_as_build_shard_holds_them(family: str, tmp_path: Path) -> None:
    """tp=2 with the MLP and the vocabulary split 3:1 (`--tp-split`): rank 0 holds more, and each rank's weights are
    exactly what the model counts (a 97-token vocabulary: rows 0-74 and 75-96)."""
    model_dir = write_checkpoint(tmp_path / family, FAMILIES[family])
    model = load_model(model_dir)
    limits = ServingLimits(kv_slots=3, max_context=40, max_batch_tokens=16)
    assert 2 in valid_tp_degrees(model.cfg)
    held = []
    for rank in range(2):
        shard = build_shard(model_dir, ShardSpec(0, 5, 5, rank, 2, (3, 1)), max_len=limits.max_context, progress=False)
        held.append(sum(p.numel() * p.element_size() for p in shard.parameters()))
        est = shard_memory(model, (0, 5), 2, rank, "float32", limits, split=(3, 1))
        assert est.weights == held[-1], (family, rank)
        options = PlanOptions(dtype="float32", limits=limits, tp_split=(3, 1))
        assert options.shard(model, (0, 5), 2, rank).weights == held[-1]
    assert held[0] > held[1]


def test_published_models_by_hand() -> None:
    """Parameter counts everyone quotes, and a KV cache computed by hand."""
    limits = ServingLimits(8, 8192, 8192)
    expect = {"llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496, "qwen2-72b": 72_706_203_648}
    for name, params in expect.items():
        model = load_model(CONFIGS / name)
        assert not model.has_weights and model.checkpoint_dtype == "bfloat16"
        whole = shard_memory(model, (0, model.cfg.num_layers), 1, 0, "bfloat16", limits)
        assert whole.weights == 2 * params, name
    assert round(2 * expect["llama-3-8b"] / 1e9, 2) == 16.06  # "Llama-3-8B in bf16 is 16.06 GB"
    # Llama-3-70B, tp=4: 80 layers × {k,v} × 8 slots × 2 of its 8 kv heads × 8192 positions × 128 × 2 bytes.
    m70 = load_model(CONFIGS / "llama-3-70b")
    assert shard_memory(m70, (0, 80), 4, 1, "bfloat16", limits).kv_cache == 80 * 2 * 8 * 2 * 8192 * 128 * 2 == 5 * GiB
    # And they fit where people run them: 8B on one 24 GiB GPU (4k context), the 70Bs on 4 × 80 GiB.
    cuda = RuntimeCosts.for_device("cuda")
    small = PlanOptions(dtype="bfloat16", limits=ServingLimits(4, 4096, 4096), runtime=cuda)
    assert plan(load_model(CONFIGS / "llama-3-8b"), parse_devices("1x24GiB"), small).pp == 1
    for name in ("llama-3-70b", "qwen2-72b"):
        p = plan(load_model(CONFIGS / name), parse_devices("4x80GiB"), PlanOptions("bfloat16", limits, cuda))
        assert (p.tp, p.pp) == (4, 1) and p.min_headroom > 30 * GiB, name


def test_memory_terms_follow_the_formulas() -> None:
    model = load_model(CONFIGS / "llama-3-8b")
    lim = ServingLimits(4, 1024, 512)
    mid = shard_memory(model, (4, 8), 2, 0, "bfloat16", lim, RuntimeCosts.for_device("cuda"))
    last = shard_memory(model, (28, 32), 2, 0, "bfloat16", lim, RuntimeCosts.for_device("cuda"))
    t, h, f, q, k, hd = 512, 4096, 14336 // 2, 16 * 128, 4 * 128, 128
    assert mid.activations == t * (2 * (2 * h + max(3 * f, 4 * q + 3 * k)) + 8 * h + 8 * hd) + t * 1024
    assert last.activations - mid.activations == 4 * 128256 * (2 * 2 + 16)  # sampled rows' logits
    assert mid.buffers == 2 * 1024 * 128 * 4 and mid.runtime == GiB
    assert mid.load == (14336 // 2) * 4096 * 2  # cuda: one slice (the largest, an MLP matrix) staged
    cpu = shard_memory(model, (4, 8), 2, 0, "bfloat16", lim)
    largest = (14336 // 2) * 4096  # an MLP slice: the shard's largest tensor and largest matrix
    # cpu: reading holds one bf16 slice twice (mapped pages + copy); the re-layout adds one matrix at a time.
    assert cpu.load == max(2 * largest * 2, largest * 2)
    assert cpu.total == cpu.runtime + cpu.weights + cpu.buffers + max(cpu.load, cpu.kv_cache + cpu.activations)
    # cpu: the compiled halves' float32 scratch, a chunk of rows at a time, where it is the larger (here: 512 rows)
    compiled = t * 2 * h * 2 + min(t, CPU_ROW_CHUNK) * 4 * (2 * h + max(3 * f, 2 * q + 2 * k))
    assert cpu.activations == max(mid.activations, compiled) > mid.activations
    long = shard_memory(model, (4, 8), 2, 0, "bfloat16", ServingLimits(4, 8192, 8192))
    eager = 8192 * (2 * (2 * h + max(3 * f, 4 * q + 3 * k)) + 8 * h + 8 * hd) + 8192 * 8192
    assert long.activations == eager  # a long step: chunks of CPU_ROW_CHUNK rows stay below eager's estimate
    assert cpu.runtime == RuntimeCosts().process and shard_memory(model, (0, 4), 2, 0, "bfloat16", lim).runtime == (
        RuntimeCosts().process + RuntimeCosts().first_stage
    )


def test_load_model_checks_every_header_against_the_config(tmp_path: Path) -> None:
    """Headers only (no torch, no weights): the stored dtype is read, and a checkpoint that does not match
    config.json is refused naming the file and the tensor."""
    model_dir = write_checkpoint(tmp_path / "m", _llama(tie_word_embeddings=True), dtype="bfloat16")
    model = load_model(model_dir)
    assert model.has_weights and model.checkpoint_dtype == "bfloat16"
    (model_dir / "config.json").write_text(json.dumps(_llama(tie_word_embeddings=True, intermediate_size=96)))
    tensor = r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight'"
    with pytest.raises(CheckpointError, match=tensor + r" has shape \[64, 48\], expected \[96, 48\] from config\.json"):
        load_model(model_dir)
    (model_dir / "config.json").write_text(json.dumps(_llama(tie_word_embeddings=False)))
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' is missing from the checkpoint"):
        load_model(model_dir)
