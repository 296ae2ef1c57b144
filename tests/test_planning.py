"""Planning: the memory model is exact where it can be, the planner's plans are valid on any device set,
an infeasible request says what is missing and what would fit, and `shardmesh plan` prints it."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardmesh.core.heads import HeadSplit, TensorParallelError
from shardmesh.core.layout import ShardSpec, split_layers
from shardmesh.engine.loader import build_shard
from shardmesh.engine.synthetic import write_checkpoint
from shardmesh.planning.devices import Device, describe_devices, make_devices, parse_devices
from shardmesh.planning.memory import Limits, ModelInfo, RuntimeCosts, load_model, shard_memory
from shardmesh.planning.planner import (
    Infeasible,
    Plan,
    PlanError,
    PlanOptions,
    capped_split,
    plan,
    try_plan,
    valid_tp_degrees,
)
from shardmesh.planning.units import format_bytes, parse_bytes
from shardmesh_cli.main import main

CONFIGS = Path(__file__).parent / "data" / "configs"
GiB = 2**30


def _llama(**over: object) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 5,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
           "max_position_embeddings": 64}  # fmt: skip
    return {**cfg, **over}


# --- units and devices --------------------------------------------------------------------------------------


def test_sizes_parse_and_print() -> None:
    assert parse_bytes("24GiB") == 24 * GiB and parse_bytes("80GB") == 80 * 10**9 and parse_bytes(512) == 512
    assert parse_bytes("1.5 MiB") == 3 * 2**19 and parse_bytes("7") == 7
    assert format_bytes(16_060_522_496) == "14.96 GiB" and format_bytes(-3 * 2**20) == "-3.00 MiB"
    for bad in ("24 gigs", "-1GiB", "GiB", ""):
        with pytest.raises(ValueError, match="expected a size like 24GiB"):
            parse_bytes(bad)


def test_device_specs() -> None:
    ds = parse_devices("4x24GiB")
    assert [d.name for d in ds] == ["node0/0", "node0/1", "node0/2", "node0/3"] and {d.memory for d in ds} == {24 * GiB}
    ds = parse_devices("nodeA:2x80GiB,nodeB:1x48GiB@0.5,nodeA:1x40GiB")
    assert [(d.name, d.memory // GiB, d.speed) for d in ds] == [
        ("nodeA/0", 80, 1.0), ("nodeA/1", 80, 1.0), ("nodeB/0", 48, 0.5), ("nodeA/2", 40, 1.0)]  # fmt: skip
    assert describe_devices(ds) == "nodeA:2x80GiB,nodeA:1x40GiB,nodeB:1x48GiB@0.5"
    for bad, why in (("4x", "COUNTxSIZE"), ("0x8GiB", "count must be >= 1"), ("2x8 parsecs", "size like"),
                     ("a:2x8GiB@0", "speed must be > 0")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_devices(bad)


# --- the memory model ---------------------------------------------------------------------------------------

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
    limits = Limits(kv_slots=3, max_context=40, max_batch_tokens=16)
    for dtype in ("float32", "bfloat16"):
        for pp in (1, 2, 3):
            for tp in [d for d in valid_tp_degrees(model.cfg) if d <= 4]:
                for start, end in split_layers(model.cfg.num_layers, pp):
                    for rank in range(tp):
                        shard = build_shard(model_dir, ShardSpec(start, end, 5, rank, tp), dtype=getattr(torch, dtype),
                                            max_len=limits.max_context, progress=False)  # fmt: skip
                        held = sum(p.numel() * p.element_size() for p in shard.parameters())
                        cache = shard.make_cache(limits.kv_slots, getattr(torch, dtype), "cpu")
                        est = shard_memory(model, (start, end), tp, rank, dtype, limits)
                        assert (est.weights, est.kv_cache) == (held, cache.nbytes), (family, dtype, pp, tp, rank)
                        assert est.buffers == sum(t.numel() * 4 for t in (shard.rope_cos, shard.rope_sin))


def test_published_models_by_hand() -> None:
    """Parameter counts everyone quotes, and a KV cache computed by hand."""
    limits = Limits(8, 8192, 8192)
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
    small = PlanOptions(dtype="bfloat16", limits=Limits(4, 4096, 4096), runtime=cuda)
    assert plan(load_model(CONFIGS / "llama-3-8b"), parse_devices("1x24GiB"), small).pp == 1
    for name in ("llama-3-70b", "qwen2-72b"):
        p = plan(load_model(CONFIGS / name), parse_devices("4x80GiB"), PlanOptions("bfloat16", limits, cuda))
        assert (p.tp, p.pp) == (4, 1) and p.min_headroom > 30 * GiB, name


def test_memory_terms_follow_the_formulas() -> None:
    model = load_model(CONFIGS / "llama-3-8b")
    lim = Limits(4, 1024, 512)
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
    assert cpu.runtime == RuntimeCosts().process and shard_memory(model, (0, 4), 2, 0, "bfloat16", lim).runtime == (
        RuntimeCosts().process + RuntimeCosts().first_stage
    )


# --- planner properties ---------------------------------------------------------------------------------------


def check_plan(p: Plan, devices: tuple[Device, ...]) -> None:
    """Everything a plan promises, checked from scratch."""
    cfg, o = p.model.cfg, p.options
    assert p.tp in valid_tp_degrees(cfg) and len(p.shards) == p.pp * p.tp
    ranges = p.layer_split
    assert ranges[0][0] == 0 and ranges[-1][1] == cfg.num_layers  # every layer placed exactly once:
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))  # contiguous
    assert sum(e - s for s, e in ranges) == cfg.num_layers and ranges[-1][0] < ranges[-1][1]
    assert len({sh.device for sh in p.shards}) == len(p.shards)  # one shard per device
    assert set(p.unused) == set(devices) - {sh.device for sh in p.shards}
    for s in range(p.pp):
        stage = [sh for sh in p.shards if sh.stage == s]
        assert [sh.tp_rank for sh in stage] == list(range(p.tp)) and [sh.rank for sh in stage] == [
            s * p.tp + r for r in range(p.tp)]  # fmt: skip
        assert len({sh.device.node for sh in stage}) == 1, "a tensor group spans nodes"
        assert len({sh.layers for sh in stage}) == 1
    for sh in p.shards:
        again = shard_memory(p.model, sh.layers, p.tp, sh.tp_rank, o.dtype, o.limits, o.runtime)
        assert sh.memory == again
        assert sh.memory.total + o.reserve <= sh.device.memory, f"{sh.device.name} over its memory"
    if o.tp is not None:
        assert p.tp == o.tp
    if o.pp is not None:
        assert p.pp == o.pp


def random_devices(rng: random.Random) -> tuple[Device, ...]:
    groups = []
    for n in range(rng.randint(1, 4)):
        for _ in range(rng.randint(1, 3)):
            groups.append((f"n{n}", rng.randint(1, 4), rng.choice([4, 8, 16, 24, 40, 48, 80, 141]) * GiB,
                           rng.choice([0.5, 1.0, 1.0, 2.0])))  # fmt: skip
    return make_devices(groups)


def test_random_uneven_device_sets_give_valid_plans_or_actionable_errors() -> None:
    rng = random.Random(1234)
    models = [load_model(CONFIGS / n) for n in ("llama-3-8b", "llama-3-70b", "qwen2-72b")]
    seen = {"fit": 0, "infeasible": 0, "uneven": 0}
    for _ in range(60):
        model, devices = rng.choice(models), random_devices(rng)
        opts = PlanOptions(
            dtype=rng.choice(["float32", "bfloat16"]), limits=Limits(rng.choice([1, 4, 16]), rng.choice([2048, 8192]),
            rng.choice([512, 2048])), runtime=RuntimeCosts.for_device(rng.choice(["cpu", "cuda"])),
            balance=rng.choice(["memory", "speed"]), reserve=rng.choice([0, GiB]),
        )  # fmt: skip
        try:
            p = plan(model, devices, opts)
        except Infeasible as e:
            seen["infeasible"] += 1
            assert e.missing > 0 and "missing" in str(e) and "closest layout: tp=" in str(e)
            for s in e.suggestions[:3]:  # each option really fits
                assert fits_after(model, devices, opts, s.changes), s.text
            continue
        seen["fit"] += 1
        seen["uneven"] += not p.even_split
        check_plan(p, devices)
    assert min(seen.values()) >= 5, seen  # the sample covered every outcome


def fits_after(model: ModelInfo, devices: tuple[Device, ...], opts: PlanOptions, changes: dict) -> bool:
    lim = opts.limits
    if "devices" in changes:
        devices = parse_devices(str(changes["devices"]))
    if "dtype" in changes:
        opts = replace(opts, dtype=str(changes["dtype"]))
    if "max_context" in changes:
        lim = Limits(lim.kv_slots, int(changes["max_context"]), int(changes["max_batch_tokens"]))  # type: ignore[arg-type]
    if "kv_slots" in changes:
        lim = replace(lim, kv_slots=int(changes["kv_slots"]))  # type: ignore[arg-type]
    return try_plan(model, devices, replace(opts, limits=lim)) is not None


def test_infeasible_names_missing_bytes_and_each_kind_of_option() -> None:
    model = load_model(CONFIGS / "llama-3-70b")
    opts = PlanOptions(dtype="float32", limits=Limits(16, 8192, 2048), runtime=RuntimeCosts.for_device("cuda"))
    with pytest.raises(Infeasible) as e:
        plan(model, parse_devices("4x80GiB"), opts)
    text = str(e.value)
    # 4 × 80 GiB against 262.8 GiB of float32 weights and 80 GiB of KV cache: tens of GiB short.
    assert 10 * GiB < e.value.missing < 60 * GiB and f"{format_bytes(e.value.missing)} missing" in text
    kinds = {next(iter(s.changes)) for s in e.value.suggestions}
    assert kinds == {"dtype", "devices", "max_context", "kv_slots"}, text
    assert "--dtype bfloat16 instead of float32" in text and "more 80GiB device" in text
    for s in e.value.suggestions:
        assert fits_after(model, parse_devices("4x80GiB"), opts, s.changes), s.text
    # The shortest context that fits is the longest that does: one more token would not.
    ctx = next(s.changes["max_context"] for s in e.value.suggestions if "max_context" in s.changes)
    longer = {"max_context": ctx + 1, "max_batch_tokens": min(2048, ctx + 1)}
    assert not fits_after(model, parse_devices("4x80GiB"), opts, longer)


def test_layers_follow_free_memory_or_speed() -> None:
    model = load_model(CONFIGS / "llama-3-8b")
    opts = PlanOptions(dtype="bfloat16", limits=Limits(4, 4096, 1024), runtime=RuntimeCosts.for_device("cuda"))
    p = plan(model, parse_devices("a:1x48GiB,b:1x16GiB,c:1x16GiB"), opts)
    check_plan(p, parse_devices("a:1x48GiB,b:1x16GiB,c:1x16GiB"))
    counts = [e - s for s, e in p.layer_split]
    assert p.tp == 1 and counts[0] > 2 * counts[1] and counts[0] > 2 * counts[2], p.layer_split
    fast = plan(model, parse_devices("a:1x48GiB,b:1x48GiB@4"), replace(opts, balance="speed"))
    assert [e - s for s, e in fast.layer_split] == [7, 25]  # split_layers: 1 each + the other 30 shared 1 : 4
    # Speed asks for more than memory allows: the slow big device takes what the fast small one cannot.
    capped = plan(model, parse_devices("a:1x48GiB,b:1x8GiB@10"), replace(opts, balance="speed"))
    check_plan(capped, parse_devices("a:1x48GiB,b:1x8GiB@10"))
    assert capped.shards[1].headroom < 2 * GiB < capped.shards[0].headroom


def test_tensor_groups_stay_in_a_node_and_prefer_fewer_stages() -> None:
    model = load_model(CONFIGS / "llama-3-70b")
    opts = PlanOptions(dtype="bfloat16", limits=Limits(8, 8192, 8192), runtime=RuntimeCosts.for_device("cuda"))
    one_node = plan(model, parse_devices("4x80GiB"), opts)
    assert (one_node.tp, one_node.pp) == (4, 1)
    two_nodes = plan(model, parse_devices("a:2x80GiB,b:2x80GiB"), opts)
    assert (two_nodes.tp, two_nodes.pp) == (2, 2) and [sh.device.node for sh in two_nodes.shards] == list("aabb")
    uneven = plan(model, parse_devices("nodeA:2x80GiB,nodeB:1x48GiB"), opts)
    check_plan(uneven, parse_devices("nodeA:2x80GiB,nodeB:1x48GiB"))
    assert uneven.tp == 1 and uneven.pp == 3 and not uneven.even_split
    with pytest.raises(PlanError, match="needs 4 devices on one node; the largest node has 2"):
        plan(model, parse_devices("a:2x80GiB,b:2x80GiB"), replace(opts, tp=4))
    with pytest.raises(PlanError, match=r"tensor degree 3 is not valid .* valid degrees: \[1, 2, 4, 8, 16, 32, 64\]"):
        plan(model, parse_devices("4x80GiB"), replace(opts, tp=3))


def test_a_device_too_small_for_a_layer_is_left_out() -> None:
    model = load_model(CONFIGS / "llama-3-8b")
    opts = PlanOptions(dtype="bfloat16", limits=Limits(4, 4096, 1024), runtime=RuntimeCosts.for_device("cuda"))
    p = plan(model, parse_devices("a:1x80GiB,a:1x1GiB"), opts)
    assert p.pp == 1 and [d.name for d in p.unused] == ["a/1"]


def test_valid_degrees_match_head_split() -> None:
    for name in ("llama-3-8b", "llama-3-70b", "qwen2-72b"):
        cfg = load_model(CONFIGS / name).cfg
        for d in range(1, 17):
            try:
                HeadSplit.of(cfg, 0, d)
                ok = cfg.intermediate_size % d == 0
            except TensorParallelError:
                ok = False
            assert (d in valid_tp_degrees(cfg)) == ok, (name, d)


def test_capped_split_is_proportional_within_caps() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stages = rng.randint(1, 6)
        caps = [rng.randint(1, 20) for _ in range(stages)]
        total = rng.randint(stages, sum(caps))
        weights = [rng.choice([0.5, 1.0, 3.0, 10.0]) for _ in range(stages)]
        split = capped_split(total, weights, caps)
        counts = [e - s for s, e in split]
        assert (
            split[0][0] == 0
            and split[-1][1] == total
            and all(1 <= c <= cap for c, cap in zip(counts, caps, strict=True))
        )
        # No stage below its cap could take a layer from one with a larger share per weight.
        for i in range(stages):
            for j in range(stages):
                if counts[i] < caps[i] and counts[j] > 1:
                    assert (counts[i] + 1) / weights[i] >= (counts[j] - 1) / weights[j] - 1e-9, (split, weights, caps)


# --- `shardmesh plan` -----------------------------------------------------------------------------------------


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
