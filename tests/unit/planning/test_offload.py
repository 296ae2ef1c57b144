"""Offload in the planner: a shard's split under a budget is the engine's (`engine.offload.plan_offload`), and a
model that does not fit is offered offload on the same devices with numbers checkable by hand (published 70B and
405B shapes), its step time from the rates given (no probe here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardmesh.core.layout import ShardSpec
from shardmesh.core.topology import ServingLimits
from shardmesh.engine import host_offload
from shardmesh.engine import offload as engine
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.loader import meta_shard
from shardmesh.models.checkpoint import Checkpoint
from shardmesh.planning import planner
from shardmesh.planning.devices import Device, parse_devices
from shardmesh.planning.link import parse_rate
from shardmesh.planning.memory import ModelInfo, RuntimeCosts, load_model
from shardmesh.planning.offload import (
    COPY,
    DEVICE,
    DEVICE_ALIGN,
    FAULT_AROUND,
    ZERO_COPY,
    LinkRates,
    Rate,
    Residency,
    mapped_bound,
    residency,
    working_set,
)
from shardmesh.planning.planner import Infeasible, PlanOptions, plan
from shardmesh.planning.report import infeasible_to_json
from shardmesh.planning.weights import weight_parts
from tests.checkpoints import make_checkpoint
from tests.unit.planning.test_int8 import LLAMA_405B

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
CUDA = RuntimeCosts.for_device("cuda")
LIMITS = ServingLimits(8, 8192, 8192)
PCIE = LinkRates(Rate(25e9, "given: --link-bandwidth"))
LAYERS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Layers of 1.3 MB of float32 products: 20 times the fault-around window, so the planner's bound on the mapped
    # pages (each read rounded out at both ends) stays well inside one layer.
    return make_checkpoint(tmp_path_factory.mktemp("offload"), "qwen2-bias-tied", num_layers=LAYERS, hidden_size=256,
                           intermediate_size=512)  # fmt: skip


def _engine_plan(model: ModelInfo, spec: ShardSpec, dtype: str, budget: int, unit: int = FAULT_AROUND,
                 quantization: str = "none", device: str = "cpu") -> engine.OffloadPlan | None:  # fmt: skip
    shard, reads = meta_shard(model.cfg, spec, UnboundGroup(spec.tp_rank, spec.tp_size), None)
    ckpt, serving = Checkpoint(model.path), getattr(torch, dtype)
    int8 = engine.int8_streams(ckpt, shard, reads, serving, False, device) if quantization == "int8" else None
    try:
        return engine.plan_offload(ckpt, shard, reads, serving, budget, device, unit=unit, int8=int8)
    except engine.BudgetError:
        return None


def _thresholds(model: ModelInfo, spec: ShardSpec, dtype: str, mode: str, unit: int = FAULT_AROUND,
                quantization: str = "none") -> list[int]:  # fmt: skip
    """The planner's least budget for k = 0..n resident layers: loaded bytes less the streamed products, plus the
    working set of the n - k streamed."""
    layers = (spec.layer_start, spec.layer_end)
    whole = residency(model, layers, spec.tp_size, spec.tp_rank, dtype, 2**62, mode, quantization=quantization)
    assert whole is not None and whole.streamed == 0
    parts = weight_parts(model.cfg, spec.tp_size, spec.tp_rank)
    b, c, n = torch.empty(0, dtype=getattr(torch, dtype)).element_size(), 4, spec.layer_end - spec.layer_start
    return [whole.resident_bytes - (n - k) * whole.layer_bytes
            + working_set(parts.layer, n - k, b, c, mode, unit, quantization) for k in range(n + 1)]  # fmt: skip


@pytest.mark.parametrize(
    ("start", "end", "rank", "tp", "dtype", "mode", "quantization"),
    [
        (0, LAYERS, 0, 1, "float32", ZERO_COPY, "none"),  # the whole model: embedding, head, every layer
        (0, 4, 1, 2, "float32", ZERO_COPY, "none"),  # a first stage's tp rank: o and down map whole rows
        (4, LAYERS, 0, 2, "float32", ZERO_COPY, "none"),  # a last stage
        (2, 6, 0, 1, "bfloat16", COPY, "none"),  # a middle stage, float32 checkpoint served in bfloat16: copied
        (0, LAYERS, 0, 1, "float32", ZERO_COPY, "int8"),  # int8 products, streamed from the int8 copy
        (0, LAYERS, 1, 2, "bfloat16", ZERO_COPY, "int8"),  # a tp rank's slices of the copy, values and scales
        (0, LAYERS, 0, 1, "bfloat16", DEVICE, "none"),  # cuda: two device buffers of a layer, products aligned
        (2, 6, 1, 2, "float32", DEVICE, "int8"),  # cuda, a tp rank's int8 values and scales
    ],
)
def test_the_split_under_a_budget_is_the_engines(
    ckpt: Path, start: int, end: int, rank: int, tp: int, dtype: str, mode: str, quantization: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """At each budget the planner says some k resident layers need, the engine keeps the same layers resident and
    streams the same bytes (k is the most that fit: two streamed layers' working set can outweigh them, so a budget
    for k may keep more); its working set, the exact mapped pages, is at most the planner's bound, within two
    fault-around windows per read of it. (Both are given the 64 KiB unit: the engine's default is this host's.)"""
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))  # where the engine writes the int8 copy
    device = "cuda" if mode == DEVICE else "cpu"  # planned only: nothing is loaded on the device
    model = load_model(ckpt)
    spec = ShardSpec(start, end, LAYERS, rank, tp)
    n = end - start
    thresholds = _thresholds(model, spec, dtype, mode, quantization=quantization)
    parts = weight_parts(model.cfg, tp, rank).layer
    reads = len(parts.int8_spans if quantization == "int8" else parts.spans)
    kept = set()
    for budget in thresholds:
        k = max(j for j, t in enumerate(thresholds) if t <= budget)
        ours = residency(model, (start, end), tp, rank, dtype, budget, mode, quantization=quantization)
        theirs = _engine_plan(model, spec, dtype, budget, quantization=quantization, device=device)
        assert ours is not None and theirs is not None, (k, budget)
        assert ours.resident == len(theirs.resident_layers) == k, (k, budget, theirs)
        assert ours.streamed_bytes_per_step == theirs.streamed_bytes_per_step
        assert ours.resident_bytes == theirs.resident_bytes
        assert theirs.zero_copy == (mode == ZERO_COPY)
        slack = min(2, n - k) * reads * 2 * FAULT_AROUND if mode != DEVICE else 0  # the device ring: exact
        assert theirs.working_set_bytes <= ours.working_set_bytes <= theirs.working_set_bytes + slack
        kept.add(k)
        below = [j for j, t in enumerate(thresholds) if t <= budget - 1]
        fewer = residency(model, (start, end), tp, rank, dtype, budget - 1, mode, quantization=quantization)
        engine_fewer = _engine_plan(model, spec, dtype, budget - 1, quantization=quantization, device=device)
        if below:  # a byte less: the planner keeps fewer, never more than the engine
            assert fewer is not None and fewer.resident == max(below) <= k
            assert engine_fewer is not None and len(engine_fewer.resident_layers) >= fewer.resident
        else:
            assert fewer is None
    # Both ends at least; between them, the splits whose two streamed layers' pages do not outweigh what they free
    # (at tp=2, o and down map whole rows: streaming fewer than all 4 layers of a stage frees nothing).
    assert {0, n} <= kept and (tp > 1 or len(kept) >= n - 1), kept
    too_small = thresholds[0] - 1
    assert residency(model, (start, end), tp, rank, dtype, too_small, mode, quantization=quantization) is None


def test_the_device_alignment_is_the_engines() -> None:
    assert DEVICE_ALIGN == host_offload.ALIGN


def test_fault_around_and_the_mapped_bound() -> None:
    assert FAULT_AROUND == engine.FAULT_AROUND
    window = FAULT_AROUND
    # Whatever its offset, a read of one byte maps one window; of a window and a byte, two; and two bytes, three.
    assert (mapped_bound(1), mapped_bound(window + 1), mapped_bound(window + 2), mapped_bound(0)) == (
        window, 2 * window, 3 * window, 0)  # fmt: skip
    for size in (1, 2, window - 1, window, window + 1, window + 2, 5 * window):
        # The windows a read of `size` bytes touches at a few offsets: the worst (one byte short of a window's
        # end, for 2 bytes or more) is the bound.
        spans = [((at + size - 1) // window - at // window + 1) * window for at in (0, 1, window // 2, window - 1)]
        assert mapped_bound(size) == max(spans), size


def test_70b_on_two_48gib_gpus_offload_by_hand() -> None:
    """At tp=2 a rank holds half of every product: (8192 + 2 × 1024) × 8192 + 8192 × 8192 + 3 × 28672 × 8192 =
    855.6M weights a layer, 427.8M per rank, 855.6 MB in bfloat16; every layer it streams is read once a step."""
    model = load_model(CONFIGS / "llama-3-70b")
    opts = PlanOptions(dtype="bfloat16", limits=LIMITS, runtime=CUDA, rates=PCIE)
    with pytest.raises(Infeasible) as e:
        plan(model, parse_devices("2x48GiB"), opts)
    found = [s for s in e.value.suggestions if s.offload is not None]
    assert len(found) == 2 and found[0].changes == {"memory_budget": found[0].offload.budget}  # type: ignore[union-attr]
    # int8 alone does not fit two 48 GiB devices either: offload with int8 products is the second (checked below)
    assert found[1].changes == {"quantization": "int8", "memory_budget": found[1].offload.budget}  # type: ignore[union-attr]
    p = found[0].offload
    assert p is not None and (p.tp, p.pp, p.mode) == (2, 1, "device")
    h, i, kv, v = 8192, 28672, 1024, 128256
    layer = (h + 2 * kv) * h + h * h + 3 * i * h
    assert layer == 855_638_016
    per_rank = layer // 2 * 2  # bytes of one layer's products on one rank, bfloat16
    sh = p.shards[0]
    r = sh.residency
    assert r.resident + r.streamed == 80 and 0 < r.streamed < 80
    assert r.streamed_bytes_per_step == r.streamed * per_rank == p.streamed_bytes_per_step
    # Resident: the leading layers whole (products and two norms) and half the embedding and the LM head, the norm.
    assert (
        r.resident_bytes == r.resident * (per_rank + 2 * h * 2) + r.streamed * 2 * h * 2 + 2 * (v // 2) * h * 2 + h * 2
    )
    assert r.working_set_bytes == 2 * per_rank  # two layer buffers on the device
    assert r.total_bytes <= p.budget < r.total_bytes + per_rank  # one more resident layer would not fit
    assert all(s.memory.total <= s.device.memory for s in p.shards) and p.budget % 2**20 == 0
    assert p.host_bytes() == {"node0": r.streamed * layer * 2}
    assert p.step_seconds() == pytest.approx(r.streamed * per_rank / 25e9)
    text = str(e.value)
    assert f"offload in bfloat16 (--memory-budget {p.budget // 2**20}MiB, device" in text
    assert f"{r.resident} layers resident + {r.streamed} streamed" in text
    assert f"{r.streamed} layers × 427.8M weights per rank × 2 bytes" in text
    assert f"= {r.streamed * per_rank / 1e9:.2f} GB / 25.00 GB/s link" in text and "not available" not in text
    got = infeasible_to_json(e.value)
    option = next(o for o in got["options"] if "offload" in o)
    assert option["offload"]["step_seconds"] == pytest.approx(r.streamed * per_rank / 25e9)
    assert option["offload"]["shards"][0]["streamed_layers"] == [r.resident, 80]
    assert json.loads(json.dumps(got)) == got


def test_70b_on_two_48gib_gpus_offload_with_int8_by_hand() -> None:
    """int8 and offload together: at tp=2 a rank's layer holds the same 427.8M weights, one byte each, plus a float16
    scale and minimum (4 bytes) for each 32 inputs of each of its rows: qkv 5120 rows of 8192 inputs, o 8192 rows
    of its 4096, gate_up 28672 rows of 8192, down 8192 rows of its 14336."""
    model = load_model(CONFIGS / "llama-3-70b")
    opts = PlanOptions(dtype="bfloat16", limits=LIMITS, runtime=CUDA, rates=PCIE)
    with pytest.raises(Infeasible) as e:
        plan(model, parse_devices("2x48GiB"), opts)
    p = next(s.offload for s in e.value.suggestions if s.offload is not None and s.offload.int8)
    assert (p.tp, p.pp, p.mode, p.quantization) == (2, 1, "device", "int8")
    scales = 4 * (5120 * 8192 // 32 + 8192 * 4096 // 32 + 28672 * 8192 // 32 + 8192 * 14336 // 32)
    per_rank = 855_638_016 // 2 + scales
    assert per_rank == 481_296_384
    r = p.shards[0].residency
    assert r.resident + r.streamed == 80 and 0 < r.streamed < 80
    assert r.streamed_bytes_per_step == r.streamed * per_rank == p.streamed_bytes_per_step
    assert r.working_set_bytes == 2 * per_rank and r.total_bytes <= p.budget < r.total_bytes + per_rank
    full_layer = 855_638_016 + 2 * scales  # both ranks' halves: the int8 copy of one layer
    assert p.host_bytes() == {"node0": r.streamed * full_layer}
    assert p.step_seconds() == pytest.approx(r.streamed * per_rank / 25e9)
    # Fewer layers stream than in bfloat16, each about half the bytes: the step waits on the link for far less.
    float_p = next(s.offload for s in e.value.suggestions if s.offload is not None and not s.offload.int8)
    assert r.streamed < float_p.shards[0].residency.streamed and p.step_seconds() < float_p.step_seconds() / 2
    text = str(e.value)
    assert f"offload in bfloat16 with int8 products (--quantize int8 --memory-budget {p.budget // 2**20}MiB" in text
    assert f"{r.streamed} layers × 481.3 MB of int8 values and scales per rank" in text
    options = infeasible_to_json(e.value)["options"]
    option = next(o for o in options if o.get("offload", {}).get("quantization") == "int8")
    assert option["changes"] == {"quantization": "int8", "memory_budget": p.budget}


def test_405b_on_eight_80gib_gpus_offload_at_tp8_with_memory_rate(tmp_path: Path) -> None:
    """tp=8 streams an eighth of each layer per device over 8 links at once; the resident weights but the
    embedding add their read at the memory rate."""
    (tmp_path / "405b").mkdir()
    (tmp_path / "405b" / "config.json").write_text(json.dumps(LLAMA_405B))
    model = load_model(tmp_path / "405b")
    rates = LinkRates(Rate(25e9, "given"), Rate(3e12, "given"))
    with pytest.raises(Infeasible) as e:
        plan(model, parse_devices("8x80GiB"), PlanOptions("bfloat16", LIMITS, CUDA, rates=rates))
    p = next(s.offload for s in e.value.suggestions if s.offload is not None)
    assert (p.tp, p.pp) == (8, 1)
    h, i, kv, v = 16384, 53248, 1024, 128256
    per_rank = ((h + 2 * kv) * h + h * h + 3 * i * h) // 8 * 2
    sh = p.critical(0)
    assert sh.residency.streamed_bytes_per_step == sh.residency.streamed * per_rank
    embedding = (v // 8) * h * 2
    assert sh.read_bytes == sh.residency.resident_bytes - embedding
    assert p.step_seconds() == pytest.approx(sh.residency.streamed * per_rank / 25e9 + sh.read_bytes / 3e12)


def test_stages_add_up_and_host_memory_is_per_node() -> None:
    """Two nodes of one device: tp=1 × pp=2; a token crosses both stages, so their streaming times add."""
    model = load_model(CONFIGS / "llama-3-70b")
    opts = PlanOptions("bfloat16", LIMITS, CUDA, rates=PCIE)
    p = planner.offload(model, parse_devices("a:1x48GiB,b:1x48GiB"), opts)
    assert p is not None and (p.tp, p.pp) == (1, 2)
    layer = 855_638_016 * 2
    streamed = [sh.residency.streamed for sh in p.shards]
    assert p.streamed_bytes_per_step == sum(streamed) * layer
    assert p.step_seconds() == pytest.approx(sum(streamed) * layer / 25e9)
    assert p.host_bytes() == {"a": streamed[0] * layer, "b": streamed[1] * layer}
    # The first stage holds the embedding, the last the LM head: one budget, so their resident layers differ.
    assert [sh.residency.layers for sh in p.shards] == [(0, 40), (40, 80)]


def test_offload_with_int8_asked_for_and_no_step_time_without_rates() -> None:
    model = load_model(CONFIGS / "llama-3-70b")
    devices = parse_devices("2x24GiB")
    with pytest.raises(Infeasible) as e:
        plan(model, devices, PlanOptions("bfloat16", LIMITS, CUDA, quantization="int8"))
    found = [s.offload for s in e.value.suggestions if s.offload is not None]
    assert len(found) == 1 and found[0].int8 and found[0].shards[0].residency.streamed > 0  # int8 is already asked for
    with pytest.raises(Infeasible) as e:
        plan(model, devices, PlanOptions("bfloat16", LIMITS, CUDA))
    p = next(s.offload for s in e.value.suggestions if s.offload is not None)
    assert p.step_seconds() is None and "step time: not predicted: give --link-bandwidth" in str(e.value)


def test_more_devices_plans_each_device_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Device, ...]] = []
    real = planner._try

    def counting(model: ModelInfo, devices: tuple[Device, ...], options: PlanOptions) -> planner.Plan | None:
        seen.append(devices)
        return real(model, devices, options)

    monkeypatch.setattr(planner, "_try", counting)
    model = load_model(CONFIGS / "llama-3-70b")
    more = planner._more_devices(model, parse_devices("2x24GiB"), PlanOptions("bfloat16", LIMITS, CUDA))
    assert more is not None and more.plan is not None
    assert len(seen) == len(set(seen)) > 1, [len(d) for d in seen]


def test_rates_parse_with_units_and_name_the_flag() -> None:
    assert parse_rate("25GB/s", "--link-bandwidth") == 25e9
    assert parse_rate("900 MiB/s", "--link-bandwidth") == 900 * 2**20
    assert parse_rate("3TB", "--memory-bandwidth") == 3e12
    for bad in ("fast", "0GB/s", "25GB/h", ""):
        with pytest.raises(ValueError, match=rf"--link-bandwidth: expected a rate like 25GB/s .* got '{bad}'"):
            parse_rate(bad, "--link-bandwidth")
    with pytest.raises(ValueError, match="link rate must be > 0"):
        LinkRates(Rate(0.0, "given"))


def test_residency_is_refused_for_a_range_outside_the_model() -> None:
    model = load_model(CONFIGS / "llama-3-70b")
    with pytest.raises(ValueError, match=r"layer range \[70, 90\) is not within \[0, 80\)"):
        residency(model, (70, 90), 1, 0, "bfloat16", 10**12, ZERO_COPY)
    assert isinstance(residency(model, (0, 80), 1, 0, "bfloat16", 10**12, ZERO_COPY), Residency)


def test_with_huge_pages_the_planner_never_promises_more_than_the_engine_keeps(ckpt: Path) -> None:
    """Where a huge page maps the page cache (`engine.offload.map_unit()` of 2 MiB), a read rounds out to 2 MiB: on
    layers of this size the bound is loose, so the planner keeps at most the engine's resident layers, and its
    budget always holds what it planned."""
    model = load_model(ckpt)
    unit = 2 * 2**20
    spec = ShardSpec(0, LAYERS, LAYERS)
    for budget in _thresholds(model, spec, "float32", ZERO_COPY, unit):
        ours = residency(model, (0, LAYERS), 1, 0, "float32", budget, ZERO_COPY, unit)
        theirs = _engine_plan(model, spec, "float32", budget, unit)
        assert ours is not None and theirs is not None and theirs.map_unit == unit
        assert ours.resident <= len(theirs.resident_layers) and ours.total_bytes <= budget
        assert theirs.working_set_bytes <= working_set(weight_parts(model.cfg, 1, 0).layer, 2, 4, 4, ZERO_COPY, unit)
