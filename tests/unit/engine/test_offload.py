"""Offload (`build_shard(..., memory_budget=N)`): layers that do not fit stream from the checkpoint each step and
give the resident shard's output; the split, the streamed bytes and the process's memory are what the plan says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine import cpu_kernels, offload
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from shardmesh.engine.offload import FAULT_AROUND, OffloadPlan, bytes_streamed, streamer_of
from tests.checkpoints import make_checkpoint, make_plain_checkpoint

LAYERS = 8
GEOMETRY = {"hidden_size": 128, "intermediate_size": 256}  # 64 KiB-sized matrices: pages, not rounding, dominate
PROMPT = [1, 5, 9, 13, 7]
PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LocalRank:
    """Rank `rank` of a tp group whose collectives are the identity: a rank's own share of every result, enough
    to compare two builds of the same rank without its peers."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: Tensor) -> Tensor:
        return x

    def all_reduce_add(self, partial: Tensor, x: Tensor) -> Tensor:
        return x + partial

    def all_gather(self, x: Tensor) -> Tensor:
        return x

    def close(self, why: str) -> None:
        pass


@pytest.fixture(scope="module")
def ck32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("f32"), "qwen2-bias-tied", num_layers=LAYERS, **GEOMETRY)


@pytest.fixture(scope="module")
def ck16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bf16")
    return make_checkpoint(d, "llama-mha-untied", num_layers=LAYERS, dtype=torch.bfloat16, **GEOMETRY)


def layer_bytes(ckpt: Path, dtype: torch.dtype, layers: range, products_only: bool = False) -> int:
    """Bytes the tensors of `layers` take in `dtype` (only their products' weights with `products_only`)."""
    total = 0
    for name, t in load_file(ckpt / "model.safetensors").items():
        parts = name.split(".")
        in_layers = len(parts) > 3 and parts[1] == "layers" and int(parts[2]) in layers
        if in_layers and (not products_only or (parts[-2] in PRODUCTS and parts[-1] == "weight")):
            total += t.numel() * dtype.itemsize
    return total


def half_budget(ckpt: Path, dtype: torch.dtype, spec: ShardSpec) -> int:
    """The shard's weights less half of its layers' bytes: about half of them stream. (A tp rank's row-parallel
    slices map whole rows, so there the working set is larger and fewer layers stay resident.)"""
    full = build_shard(ckpt, spec, LocalRank(spec.tp_rank, spec.tp_size), dtype=dtype, progress=False)
    weights = sum(p.numel() * p.element_size() for p in full.parameters())
    return weights - layer_bytes(ckpt, dtype, range(LAYERS)) // spec.tp_size // 2


def run(model: Transformer, dtype: torch.dtype, steps: int = 4) -> tuple[list[int], Tensor]:
    """Greedy tokens and the logits behind them: a prefill, then `steps` decode steps."""
    cache = model.make_cache(1, dtype, "cpu")
    ids, start, tokens, logits = PROMPT, 0, [], []
    with torch.inference_mode():
        for _ in range(steps + 1):
            out = model(torch.tensor(ids), BatchLayout.build([Segment(0, start, len(ids))]), cache)[-1]
            start += len(ids)
            ids = [int(out.argmax())]
            tokens.append(ids[0])
            logits.append(out)
    return tokens, torch.stack(logits)


def plan_of(model: Transformer) -> OffloadPlan:
    streamer = streamer_of(model)
    assert streamer is not None, "nothing streams"
    return streamer.plan


@pytest.mark.parametrize(
    ("which", "dtype", "tp_rank", "tp", "kernel"),
    [
        ("ck32", torch.float32, 0, 1, "streamed"),  # zero copy, stacked blocks with biases (qwen2)
        ("ck16", torch.bfloat16, 0, 1, "streamed"),  # zero copy in bfloat16
        ("ck32", torch.bfloat16, 0, 1, "streamed-copy"),  # converted into the two buffers
        ("ck32", torch.float32, 1, 2, "streamed"),  # a tp rank: row-parallel products multiply strided slices
        ("ck16", torch.bfloat16, 1, 2, "streamed"),
    ],
)
def test_half_the_layers_streamed_gives_the_resident_output(
    request: pytest.FixtureRequest,
    which: str,
    dtype: torch.dtype,
    tp_rank: int,
    tp: int,
    kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ckpt = request.getfixturevalue(which)
    spec = ShardSpec(0, LAYERS, LAYERS, tp_rank, tp)
    group = LocalRank(tp_rank, tp)  # the rank's own outputs: no peers, the same for both builds
    resident = build_shard(ckpt, spec, group, dtype=dtype, progress=False)
    budget = half_budget(ckpt, dtype, spec) + (layer_bytes(ckpt, dtype, range(LAYERS)) // 8 if tp > 1 else 0)
    streamed = build_shard(ckpt, spec, group, dtype=dtype, progress=False, memory_budget=budget)
    plan = plan_of(streamed)
    assert len(plan.resident_layers) > 0 and len(plan.streamed_layers) >= LAYERS // 2
    assert kernel in streamed.linear_kernels
    want_tokens, want = run(resident, dtype)
    calls = []
    monkeypatch.setattr(offload.cpu_kernels, "rows_linear",
                        lambda *a, real=offload.cpu_kernels.rows_linear: calls.append(1) or real(*a))  # fmt: skip
    tokens, got = run(streamed, dtype)
    assert tokens == want_tokens
    # Streamed products multiply the mapped weights row-major (`cpu_kernels.rows_linear` for float32 decode rows,
    # F.linear otherwise), resident ones with the kernel chosen for the dtype: the same numbers up to the order
    # of the sums.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert bool(calls) == (dtype == torch.float32 and cpu_kernels.available())


def test_split_and_bytes_streamed_are_the_computed_numbers(ck32: Path) -> None:
    spec = ShardSpec(0, LAYERS, LAYERS)
    budget = half_budget(ck32, torch.float32, spec)
    model = build_shard(ck32, spec, dtype=torch.float32, progress=False, memory_budget=budget)
    plan = plan_of(model)
    streamed = plan.streamed_layers
    assert plan.resident_layers == range(0, streamed.start) and streamed.stop == LAYERS
    # Resident: exactly the parameters the model holds (streamed products hold none).
    assert plan.resident_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    per_layer = layer_bytes(ck32, torch.float32, range(1), products_only=True)
    assert plan.streamed_bytes_per_step == layer_bytes(ck32, torch.float32, streamed, products_only=True)
    assert plan.streamed_bytes_per_step == per_layer * len(streamed)
    # Working set: the two layers in the process at once, each its bytes rounded out to the mapping unit (here the
    # fault-around window: huge pages would not fit this budget, see the test below).
    assert plan.map_unit == FAULT_AROUND
    assert 2 * per_layer <= plan.working_set_bytes <= 2 * (per_layer + 2 * plan.map_unit)
    assert plan.total_bytes <= budget < plan.total_bytes + per_layer  # one more resident layer would not fit
    assert bytes_streamed(model) == 0
    run(model, torch.float32, steps=3)
    assert bytes_streamed(model) == 4 * plan.streamed_bytes_per_step  # the prefill and 3 decode steps


def test_the_worker_counter_grows_by_the_plans_bytes_every_step(ck32: Path) -> None:
    """Through a real shard and the worker's metrics: each forward adds exactly the plan's bytes to
    shardmesh_offload_streamed_bytes_total, and the reads' bytes, their seconds and the bound are exported."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from shardmesh.core.topology import ShardState
    from shardmesh.engine.offload import stats
    from shardworker.metrics import WorkerMetrics

    spec = ShardSpec(0, LAYERS, LAYERS)
    model = build_shard(ck32, spec, progress=False, memory_budget=half_budget(ck32, torch.float32, spec))
    plan = plan_of(model)
    info = {"weights_bytes": 0, "kv_cache_bytes": 0, "total_slots": 0, "free_slots": 0, "placement": None,
            "state": ShardState.READY}  # fmt: skip
    registry = WorkerMetrics(lambda: {**info, "bytes_streamed": bytes_streamed(model), "offload": stats(model)},
                             lambda: "w0", "cpu").registry  # fmt: skip

    def scrape() -> dict[str, float]:
        text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    before = scrape()
    assert before["shardmesh_offload_planned_bytes_per_step"] == plan.streamed_bytes_per_step
    assert before["shardmesh_offload_bound_bytes_per_second"] > 0  # measured at load
    cache = model.make_cache(1, torch.float32, "cpu")
    ids = PROMPT
    with torch.inference_mode():
        for start in range(4):  # one token at a time: a step per token
            model(torch.tensor(ids[start : start + 1]), BatchLayout.build([Segment(0, start, 1)]), cache)
            after = scrape()
            grew = after["shardmesh_offload_streamed_bytes_total"] - before["shardmesh_offload_streamed_bytes_total"]
            assert grew == plan.streamed_bytes_per_step
            # Every layer handed over was read, and at most one more: the next step's first, prefetched by now
            # or not (the reader thread's; the shard may map its layers inline instead).
            read = after["shardmesh_offload_read_bytes_total"]
            streamed = after["shardmesh_offload_streamed_bytes_total"]
            assert streamed <= read <= streamed + plan.streamed_bytes_per_step // len(plan.streamed_layers)
            assert after["shardmesh_offload_read_seconds_total"] > before["shardmesh_offload_read_seconds_total"]
            assert after["shardmesh_offload_wait_seconds_total"] >= before["shardmesh_offload_wait_seconds_total"]
            before = after


def test_huge_page_mappings_are_planned_only_where_they_fit(ck32: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A huge page maps 2 MiB around each read: a layer's bytes count rounded out to it. A budget that fits only
    with the fault-around window gets that plan instead; an ample one gets huge pages."""
    from shardmesh.engine import offload
    from shardmesh.engine.loader import meta_shard
    from shardmesh.models.checkpoint import Checkpoint

    huge = 2 * 2**20
    monkeypatch.setattr(offload, "map_unit", lambda: huge)
    spec = ShardSpec(0, LAYERS, LAYERS)
    model, reads = meta_shard(build_shard(ck32, spec, progress=False).cfg, spec, LocalRank(0, 1), None)
    ckpt = Checkpoint(ck32)
    small = offload.plan_offload(ckpt, model, reads, torch.float32, 10**9, unit=FAULT_AROUND)
    half = half_budget(ck32, torch.float32, spec)
    assert offload.plan_offload(ckpt, model, reads, torch.float32, half).map_unit == FAULT_AROUND
    with pytest.raises(offload.BudgetError):
        offload.plan_offload(ckpt, model, reads, torch.float32, half, unit=huge)
    ample = small.resident_bytes + 2 * huge + 2 * layer_bytes(ck32, torch.float32, range(1), products_only=True)
    plan = offload.plan_offload(ckpt, model, reads, torch.float32, ample)
    assert plan.map_unit == huge and plan.working_set_bytes % huge == 0 and plan.total_bytes <= ample


def test_a_budget_the_whole_shard_fits_streams_nothing(ck32: Path) -> None:
    spec = ShardSpec(2, 5, LAYERS)
    resident = build_shard(ck32, spec, progress=False)
    size = sum(p.numel() * p.element_size() for p in resident.parameters())
    model = build_shard(ck32, spec, progress=False, memory_budget=size)
    assert streamer_of(model) is None and bytes_streamed(model) == 0
    assert model.linear_kernels == resident.linear_kernels


def test_too_small_a_budget_names_the_numbers(ck32: Path) -> None:
    spec = ShardSpec(0, LAYERS, LAYERS)
    with pytest.raises(ValueError, match=r"memory budget 1000 B \(1000 B\) is too small for layers \[0, 8\)") as e:
        build_shard(ck32, spec, progress=False, memory_budget=1000)
    need = int(re.search(r"needs at least (\d+) B", str(e.value)).group(1))  # type: ignore[union-attr]
    # The least that works: the resident parts and two streamed layers' pages; a byte less is refused.
    assert need > 2 * layer_bytes(ck32, torch.float32, range(1), products_only=True)
    assert plan_of(build_shard(ck32, spec, progress=False, memory_budget=need)).streamed_layers == range(0, LAYERS)
    with pytest.raises(ValueError, match=rf"memory budget {need - 1} B .* needs at least {need} B"):
        build_shard(ck32, spec, progress=False, memory_budget=need - 1)


def test_a_middle_stage_with_every_layer_streamed(ck32: Path) -> None:
    """No embedding, no head, no resident layer: hidden states in, hidden states out, as resident."""
    spec = ShardSpec(3, 6, LAYERS)
    resident = build_shard(ck32, spec, progress=False)
    need = re.search(r"needs at least (\d+) B", _refusal(ck32, spec))
    assert need is not None
    streamed = build_shard(ck32, spec, progress=False, memory_budget=int(need.group(1)))
    assert plan_of(streamed).streamed_layers == range(3, 6)
    x = torch.randn(len(PROMPT), 128)
    batch = BatchLayout.build([Segment(0, 0, len(PROMPT))])
    with torch.inference_mode():
        want = resident(x, batch, resident.make_cache(1, torch.float32, "cpu"))
        got = streamed(x, batch, streamed.make_cache(1, torch.float32, "cpu"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _refusal(ckpt: Path, spec: ShardSpec) -> str:
    with pytest.raises(ValueError) as e:
        build_shard(ckpt, spec, progress=False, memory_budget=1)
    return str(e.value)


def _int8_bytes(ckpt: Path, layers: range, tp: int) -> int:
    """A rank's int8 bytes of these layers' products, by hand: one byte a weight and 4 (a float16 scale and minimum)
    per 32 inputs of each of its rows; a column-parallel product has 1/tp of the rows, a row-parallel one 1/tp of the
    inputs."""
    total = 0
    for name, t in load_file(ckpt / "model.safetensors").items():
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and int(parts[2]) in layers and parts[-2] in PRODUCTS \
                and parts[-1] == "weight":  # fmt: skip
            rows, cols = t.shape
            rows, cols = (rows, cols // tp) if parts[-2] in ("o_proj", "down_proj") else (rows // tp, cols)
            total += rows * cols + 4 * rows * -(-cols // 32)
    return total


def int8_half_budget(ckpt: Path, resident: Transformer, tp: int) -> int:
    """The resident int8 shard's bytes (parameters and scales) less half its layers' int8 bytes (a tp rank's
    row-parallel slices map whole rows, so a quarter of them back there)."""
    held = sum(t.numel() * t.element_size() for t in resident.parameters())
    held += sum(b.numel() * b.element_size() for n, b in resident.named_buffers() if n.endswith("weight_scale"))
    layers = _int8_bytes(ckpt, range(LAYERS), tp)
    return held - layers // 2 + (layers // 4 if tp > 1 else 0)


@pytest.mark.parametrize(
    ("which", "dtype", "tp_rank", "tp", "kernel"),
    [
        ("ck32", torch.float32, 0, 1, "int8-blocked"),  # float32 decode rows: `int8_cpu` on the mapped int8 rows
        ("ck32", torch.float32, 1, 2, "int8-blocked"),  # a tp rank: row-parallel slices of inputs, strided rows
        ("ck16", torch.bfloat16, 0, 1, "int8-dequant"),  # bfloat16: the dequantized weight
    ],
)
def test_int8_layers_stream_from_the_int8_copy_and_give_the_resident_int8_output(
    request: pytest.FixtureRequest, which: str, dtype: torch.dtype, tp_rank: int, tp: int, kernel: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`--quantize int8` under a budget: the leading layers resident in int8 as any int8 shard's, the others' products
    mapped from the int8 copy written once into the cache (one file per layer: int8 `weight` and float16
    `weight_scale`, each the checkpoint's tensor quantized whole), the plan's int8 bytes streamed every step, and
    the resident int8 shard's tokens and logits; a second build reads the copy and writes nothing."""
    from shardmesh.core.dtypes import Quantization
    from shardmesh.engine.int8_copy import copy_dir, layer_file
    from shardmesh.engine.linear import quantize_groups
    from shardmesh.models.checkpoint import Checkpoint

    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))
    ckpt = request.getfixturevalue(which)
    spec, group, int8 = ShardSpec(0, LAYERS, LAYERS, tp_rank, tp), LocalRank(tp_rank, tp), Quantization.INT8
    resident = build_shard(ckpt, spec, group, dtype=dtype, progress=False, quantization=int8)
    assert kernel in resident.linear_kernels
    budget = int8_half_budget(ckpt, resident, tp)
    streamed = build_shard(ckpt, spec, group, dtype=dtype, progress=False, quantization=int8, memory_budget=budget)
    plan = plan_of(streamed)
    assert len(plan.resident_layers) > 0 and len(plan.streamed_layers) >= LAYERS // 4 and plan.zero_copy
    assert "streamed-int8" in streamed.linear_kernels and plan.total_bytes <= budget
    assert plan.streamed_bytes_per_step == _int8_bytes(ckpt, plan.streamed_layers, tp)
    want_tokens, want = run(resident, dtype)
    before = bytes_streamed(streamed)
    tokens, got = run(streamed, dtype)
    assert bytes_streamed(streamed) - before == 5 * plan.streamed_bytes_per_step  # a prefill and 4 steps
    assert tokens == want_tokens
    # The same int8 numbers, multiplied by another loop (summed in another order) or dequantized alike.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    copy = copy_dir(Checkpoint(ckpt), dtype)
    files = sorted(copy.glob("*.safetensors"))
    assert files == [layer_file(copy, i) for i in range(LAYERS)]
    name = "model.layers.5.self_attn.o_proj.weight"
    stored = load_file(layer_file(copy, 5))
    values, scale = quantize_groups(load_file(ckpt / "model.safetensors")[name].to(dtype))
    assert torch.equal(stored[name], values) and torch.equal(stored[name + "_scale"], scale)
    written = [f.stat().st_mtime_ns for f in files]
    build_shard(ckpt, spec, group, dtype=dtype, progress=False, quantization=int8, memory_budget=budget)
    assert [f.stat().st_mtime_ns for f in files] == written


def test_int8_streaming_refuses_a_slice_of_inputs_off_the_groups_and_a_budget_too_small(
    ck32: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardmesh.core.dtypes import Quantization
    from shardmesh.engine.int8_copy import int8_reads
    from shardmesh.models.checkpoint import TensorRead

    read = TensorRead("o.weight", "model.layers.0.self_attn.o_proj.weight", (128, 128), (slice(None), slice(48, 96)))
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.o_proj.weight' is split at inputs \[48, 96\) of "
                                         r"128, not at multiples of the int8 group \(32\)"):  # fmt: skip
        int8_reads(read)
    weights, scales = int8_reads(TensorRead("o.weight", "o.weight", (128, 128), (slice(None), slice(64, 128))))
    assert scales.source == "o.weight_scale" and scales.full_shape == (128, 4, 2)
    assert scales.index == (slice(None), slice(2, 4)) and weights.index == (slice(None), slice(64, 128))
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"is too small for layers \[0, 8\) in float32 with int8 products: it needs"):
        build_shard(ck32, ShardSpec(0, LAYERS, LAYERS), progress=False, memory_budget=1,
                    quantization=Quantization.INT8)  # fmt: skip


# --- memory: the process holds the budget, not the shard --------------------------------------------------------

BIG_LAYERS, HIDDEN, FFN, VOCAB = 8, 512, 1536, 4096

_MEASURE = """
import json, sys
import torch
from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine import cpu_kernels, offload
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.loader import build_shard
from shardmesh.engine.offload import streamer_of

def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

budget = int(sys.argv[2]) or None
torch.set_num_threads(1)
with torch.inference_mode():  # warm the runtime up on something tiny first: it is no part of either shard
    torch.nn.functional.linear(torch.randn(4, 64), torch.randn(64, 64)).sum()
open("/proc/self/clear_refs", "w").write("5")  # reset the peak: count only what loading and serving add
before = status("VmRSS")
model = build_shard(sys.argv[1], ShardSpec(0, 8, 8), progress=False, max_len=64, memory_budget=budget)
cache = model.make_cache(1, torch.float32, "cpu")
ids, start = list(range(1, 17)), 0
with torch.inference_mode():
    for _ in range(6):
        out = model(torch.tensor(ids), BatchLayout.build([Segment(0, start, len(ids))]), cache)
        start, ids = start + len(ids), [int(out[-1].argmax())]
weights = sum(p.numel() * p.element_size() for p in model.parameters())
s = streamer_of(model)
print(json.dumps({"peak_added": status("VmHWM") - before, "weights": weights,
                  "planned": s.plan.total_bytes if s else weights, "huge_pages": s.huge_pages if s else None}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_plain_checkpoint(
        tmp_path_factory.mktemp("big"), layers=BIG_LAYERS, hidden=HIDDEN, ffn=FFN, vocab=VOCAB, scaled=True
    )
    for f in path.glob("*.safetensors"):  # written back: clean pages, which a streamer may have read back in huge
        with f.open("rb") as fh:  # folios (`LayerStreamer.settle`), as a checkpoint written long ago would be
            os.fsync(fh.fileno())
    return path


def _measure(checkpoint: Path, budget: int) -> dict:
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(checkpoint), str(budget)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_rss_stays_within_the_budget_plus_the_fixed_overhead(big_checkpoint: Path) -> None:
    resident = _measure(big_checkpoint, 0)
    # The fixed overhead: what serving adds beyond the weights (the KV cache, activations, the allocator's and
    # oneDNN's buffers, the packing copy of one matrix while loading), measured on the resident shard.
    overhead = resident["peak_added"] - resident["weights"]
    layers = layer_bytes(big_checkpoint, torch.float32, range(BIG_LAYERS))
    budget = resident["weights"] - layers // 2
    streamed = _measure(big_checkpoint, budget)
    assert streamed["planned"] <= budget
    assert streamed["peak_added"] <= budget + overhead, (streamed, resident, overhead)
    # Not vacuous: the streamed process holds far less than the resident one (a ~109 MB shard of layers, half
    # of it outside the budget).
    assert streamed["peak_added"] < resident["peak_added"] - layers // 4, (streamed, resident)


@pytest.mark.parametrize(
    ("which", "tp_rank", "tp", "kernel"),
    [
        ("ck32", 0, 1, "streamed"),
        ("ck32", 1, 2, "streamed"),
        ("ck16", 0, 1, "streamed-copy"),
        ("ck32", 0, 1, "streamed-int8"),  # int8 rows and their scales, mapped from the int8 copy
        ("ck32", 1, 2, "streamed-int8"),  # a tp rank's row-parallel slices of them: strided rows, sliced scales
    ],
)
def test_streamed_layers_decode_natively_as_eager_does(
    which: str, tp_rank: int, tp: int, kernel: str, request: pytest.FixtureRequest, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A float32 shard with half its layers streamed decodes through `cpu_decode`'s layer halves: resident layers'
    blocked weights, streamed ones' mapped row-major blocks (stacked qkv / gate_up block by block, a tp rank's
    column slices; an int8 shard's int8 blocks with their scales), or, from a bfloat16 checkpoint, the two buffers
    they are copied into, each layer brought in and dropped around its calls. Step after step, the same logits and
    KV cache as the eager streamed model, and the plan's bytes streamed per step (the eager model a second build, so
    that the native one's layers take their buffers in turn as serving does); copied layers come into both buffers,
    and their arguments follow them."""
    from shardmesh.core.dtypes import Quantization
    from shardmesh.engine.cpu_decode import STREAMED_ROWS, cpu_decode
    from tests.unit.engine.test_model import PROMPTS, prefilled

    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path))  # where an int8 shard writes its int8 copy
    ckpt: Path = request.getfixturevalue(which)
    spec = ShardSpec(0, LAYERS, LAYERS, tp_rank, tp)
    quantization = Quantization.INT8 if kernel == "streamed-int8" else Quantization.NONE
    if quantization == Quantization.INT8:
        resident = build_shard(ckpt, spec, LocalRank(tp_rank, tp), dtype=torch.float32, progress=False,
                               quantization=quantization)  # fmt: skip
        budget = int8_half_budget(ckpt, resident, tp)
    else:
        budget = half_budget(ckpt, torch.float32, spec) + (
            layer_bytes(ckpt, torch.float32, range(LAYERS)) // 8 if tp > 1 else 0
        )
    model, eager_model = (build_shard(ckpt, spec, LocalRank(tp_rank, tp), dtype=torch.float32, progress=False,
                                      max_len=64, memory_budget=budget, quantization=quantization)
                          for _ in range(2))  # fmt: skip
    assert plan_of(model).streamed_layers and plan_of(model).resident_layers
    slots = [1, 0]
    eager_cache, native_cache = prefilled(eager_model, slots, torch.float32), prefilled(model, slots, torch.float32)
    runner = cpu_decode(model, native_cache, torch.device("cpu"))
    assert runner is not None
    # a step of more rows than the streamed products' loop is faster for goes to the eager model's
    assert runner.accepts(BatchLayout.build([Segment(0, 0, STREAMED_ROWS)]), all_logits=False)
    assert not runner.accepts(BatchLayout.build([Segment(0, 0, STREAMED_ROWS + 1)]), all_logits=False)
    streamer = streamer_of(model)
    assert {k.name for layer in streamer.layers.values() for k in layer.kernels.values()} == {kernel}
    came_in: dict[int, set[int]] = {}
    acquire = streamer.acquire

    def recorded(index: int) -> int:
        slot = acquire(index)
        came_in.setdefault(index, set()).add(slot)
        return slot

    streamer.acquire = recorded  # type: ignore[method-assign]
    ids = torch.tensor([3, 8])
    for step in range(3):
        batch = BatchLayout.build([Segment(s, len(PROMPTS[i]) + step, 1) for i, s in enumerate(slots)])
        with torch.inference_mode():
            eager = eager_model(ids, batch, eager_cache)
            before = streamer.bytes_streamed
            native = runner.run(batch, ids)
        assert streamer.bytes_streamed - before == plan_of(model).streamed_bytes_per_step
        torch.testing.assert_close(native, eager, atol=1e-5, rtol=0)
        torch.testing.assert_close(native_cache.data, eager_cache.data, atol=1e-5, rtol=0)
        ids = native.argmax(-1)
    assert runner._all is None  # streamed layers come in around their own calls, a call per half
    if kernel == "streamed-copy":  # an odd number of layers stream: each comes into the other buffer at each step
        assert len(plan_of(model).streamed_layers) % 2 == 1 and all(len(u) == 2 for u in came_in.values()), came_in
