"""int8 in the memory model and the planner: weights equal what `build_shard(quantization=INT8)` holds, the load
transient follows its formula, and a model that does not fit is told, with numbers checkable by hand, whether
int8 or more devices would fit it (published 70B and 405B shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.replan import planner_check
from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import ShardSpec, split_layers
from shardmesh.core.topology import ModelSpec, ServingLimits
from shardmesh.engine.loader import build_shard
from shardmesh.planning.devices import parse_devices
from shardmesh.planning.memory import RuntimeCosts, load_model, shard_memory
from shardmesh.planning.planner import Infeasible, PlanOptions, plan, try_plan
from shardmesh.planning.report import infeasible_to_json
from shardmesh_cli.main import main
from tests.checkpoints import FAMILIES, make_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
GiB = 2**30
CUDA = RuntimeCosts.for_device("cuda")
# Llama-3.1-405B's published config.json (meta-llama/Llama-3.1-405B), the fields the planner reads.
LLAMA_405B = {
    "_name_or_path": "meta-llama/Llama-3.1-405B", "architectures": ["LlamaForCausalLM"], "hidden_size": 16384,
    "intermediate_size": 53248, "max_position_embeddings": 131072, "num_attention_heads": 128,
    "num_hidden_layers": 126, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_weights_equal_what_build_shard_holds(family: str, tmp_path: Path) -> None:
    """Exact, for the first, a middle and the last stage at tp=1 and tp=2: int8 values, float32 scales (buffers)
    and the float embedding, norms, biases and LM head, as the loader holds them."""
    model_dir = make_checkpoint(tmp_path / family, family)
    model = load_model(model_dir)
    limits = ServingLimits(kv_slots=2, max_context=32, max_batch_tokens=8)
    for dtype in ("float32", "bfloat16"):
        for tp in (1, 2):
            for start, end in split_layers(model.cfg.num_layers, 3):
                for rank in range(tp):
                    spec = ShardSpec(start, end, model.cfg.num_layers, rank, tp)
                    shard = build_shard(model_dir, spec, dtype=getattr(torch, dtype), max_len=limits.max_context,
                                        progress=False, quantization=Quantization.INT8)  # fmt: skip
                    held = sum(t.numel() * t.element_size() for t in (*shard.parameters(), *shard.buffers()))
                    assert any(t.dtype == torch.int8 for t in shard.parameters())
                    est = shard_memory(model, (start, end), tp, rank, dtype, limits, quantization="int8")
                    assert est.weights == held, (family, dtype, tp, start, rank)
                    dense = shard_memory(model, (start, end), tp, rank, dtype, limits)
                    assert est.weights < dense.weights and est.kv_cache == dense.kv_cache


def test_int8_weights_and_load_by_hand() -> None:
    """Llama-3-8B at tp=2, a middle stage: every term from the config by hand."""
    model = load_model(CONFIGS / "llama-3-8b")
    lim = ServingLimits(4, 1024, 512)
    h, f, q, kv = 4096, 14336 // 2, 16 * 128, 4 * 128  # this rank's MLP columns, query and kv rows
    products = (q + 2 * kv) * h + h * q + 2 * f * h + h * f
    # int8 + a float16 scale and minimum (4 bytes) per 32 inputs of a row + the two norms in bfloat16
    mid = shard_memory(model, (4, 8), 2, 0, "bfloat16", lim, CUDA, "int8")
    assert mid.weights == 4 * (products + 4 * products // 32 + 2 * h * 2)
    gate_up = 2 * f * h  # the largest product: read in bfloat16, then quantized 2^20 elements at a time (48 B each)
    assert mid.load == gate_up * 2 + 2**20 * 48
    cpu = shard_memory(model, (4, 8), 2, 0, "bfloat16", lim, quantization="int8")
    assert cpu.load == max(2 * f * h * 2, gate_up * 2 + 2**20 * 48)  # the CPU maps gate's read and copies it
    # The last stage adds the final norm in bfloat16 and half the LM head's rows in int8, with their scales.
    last = shard_memory(model, (28, 32), 2, 0, "bfloat16", lim, quantization="int8")
    v = 128256 // 2
    assert last.weights - mid.weights == v * h + 4 * v * h // 32 + h * 2


def test_70b_on_two_48gib_gpus_is_offered_int8_with_numbers(tmp_path: Path) -> None:
    """141.11 GB of bfloat16 weights cannot fit in 2 × 48 GiB = 103.08 GB; int8's 80.29 GB can, with 4 KV slots."""
    model = load_model(CONFIGS / "llama-3-70b")
    devices = parse_devices("2x48GiB")
    opts = PlanOptions(dtype="bfloat16", limits=ServingLimits(4, 8192, 8192), runtime=CUDA)
    with pytest.raises(Infeasible) as e:
        plan(model, devices, opts)
    t = e.value.totals
    assert t is not None and t.parameters == 70_553_706_496 and t.weights["none"] == 2 * t.parameters
    # int8 by hand: 80 layers of products (1 byte each + a 4-byte scale and minimum per 32 inputs of a row) and
    # bfloat16 norms, the LM head in int8 too, plus the bfloat16 embedding and final norm.
    h, i, kv, v = 8192, 28672, 1024, 128256
    products = (h + 2 * kv) * h + h * h + 2 * i * h + h * i
    layer = products + 4 * products // 32 + 2 * h * 2
    assert t.weights["int8"] == 80 * layer + v * h * 2 + v * h + 4 * v * h // 32 + h * 2
    assert f"{t.weights['int8'] / 1e9:.2f}" == "80.29" and t.budget == 2 * 48 * GiB
    first = e.value.suggestions[0]
    assert first.changes == {"quantization": "int8"} and first.plan is not None
    assert try_plan(model, devices, PlanOptions("bfloat16", opts.limits, CUDA, quantization="int8")) is not None
    sh = first.plan.shards[0]
    text = str(e.value)
    assert f"--quantize int8 on the same devices: tp={first.plan.tp}" in text
    assert f"weights {sh.memory.weights / 1e9:.2f} GB" in text and "of 51.54 GB (48GiB)" in text
    assert "more 48GiB devices in bfloat16" in text and "offload in bfloat16 (--memory-budget" in text
    got = infeasible_to_json(e.value)
    assert got["weights"]["bytes"] == t.weights
    assert any(o["changes"].keys() == {"memory_budget"} and o["offload"]["tp"] >= 1 for o in got["options"])
    proposal = got["options"][0]["plan"]
    assert proposal["quantization"] == "int8" and all(s["total"] + s["headroom"] == s["device_memory"]
                                                     for s in proposal["shards"])  # fmt: skip


def test_405b_on_one_node_of_eight_80gib_gpus(tmp_path: Path) -> None:
    """811.71 GB of bfloat16 weights against 8 × 80 GiB = 687.19 GB: int8 (458.43 GB) fits on the same node, and
    bfloat16 needs more devices; both say how much each device holds."""
    (tmp_path / "405b").mkdir()
    (tmp_path / "405b" / "config.json").write_text(json.dumps(LLAMA_405B))
    model = load_model(tmp_path / "405b")
    opts = PlanOptions(dtype="bfloat16", limits=ServingLimits(8, 8192, 8192), runtime=CUDA)
    with pytest.raises(Infeasible) as e:
        plan(model, parse_devices("8x80GiB"), opts)
    t = e.value.totals
    assert t is not None and t.parameters == 405_853_388_800
    assert (f"{t.weights['none'] / 1e9:.2f}", f"{t.weights['int8'] / 1e9:.2f}") == ("811.71", "458.43")
    kinds = [s.changes for s in e.value.suggestions]
    assert kinds[0] == {"quantization": "int8"} and any("devices" in k and "quantization" not in k for k in kinds)
    int8 = e.value.suggestions[0].plan
    assert int8 is not None and (int8.tp, int8.pp) == (8, 1)
    # Per device at tp=8: an eighth of every layer's products and of the vocabulary rows, by hand.
    h, i, kv, v = 16384, 53248, 1024, 128256
    local = ((h + 2 * kv) * h + h * h + 2 * i * h + h * i) // 8
    layer = local + 4 * local // 32 + 2 * h * 2
    head = (v // 8) * h + 4 * (v // 8) * h // 32  # int8, as the layers' products
    assert int8.shards[0].memory.weights == 126 * layer + (v // 8) * h * 2 + head + h * 2
    assert "of 85.90 GB (80GiB)" in str(e.value)


def test_plan_command_quantize(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model = str(CONFIGS / "llama-3-70b")
    base = [
        "plan",
        "--model",
        model,
        "--devices",
        "2x48GiB",
        "--dtype",
        "bfloat16",
        "--device",
        "cuda",
        "--kv-slots",
        "4",
    ]
    assert main(base) == 1
    err = capsys.readouterr().err
    assert "--quantize int8 on the same devices" in err and "80.29 GB with --quantize int8" in err
    assert main([*base, "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["options"][0]["changes"] == {"quantization": "int8"} and got["options"][0]["plan"]["tp"] >= 1
    assert main([*base, "--quantize", "int8"]) == 0
    out = capsys.readouterr().out
    assert "serving: bfloat16, int8 weights" in out and "note: int8:" in out
    assert main([*base, "--quantize", "int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantization"] == "int8"
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"model:\n  path: {model}\n")
    assert main(["plan", "--manifest", str(manifest), "--quantize", "int8"]) == 2
    assert "--quantize: the manifest sets this (model.quantization)" in capsys.readouterr().err


def test_replan_check_uses_the_topologys_quantization() -> None:
    """The coordinator's re-plan asks the same memory model: 70B at tp=2 fits two 48 GiB GPUs (4 KV slots) only as
    int8."""
    cfg = load_model(CONFIGS / "llama-3-70b").cfg
    spec = ModelSpec(str(CONFIGS / "llama-3-70b"), "bfloat16", "LlamaForCausalLM", cfg.num_layers, cfg.hidden_size,
                     cfg.vocab_size, 8192)  # fmt: skip
    limits = ServingLimits(4, 8192, 8192)
    memory, kinds = [48 * GiB] * 2, ["cuda"] * 2
    assert "hold" in planner_check(spec, limits, 2)(1, ((0, 80),), memory, kinds)
    int8 = ModelSpec(**{**spec.__dict__, "quantization": "int8"})
    assert planner_check(int8, limits, 2)(1, ((0, 80),), memory, kinds) == ""
