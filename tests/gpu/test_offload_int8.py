"""int8 and offload on a GPU: the Triton int8 product against the weight dequantized in a float product; a CUDA
shard with half its layers streamed from pinned host memory against the same shard resident (eager and replayed
from CUDA graphs, float32, bfloat16 and int8); int8 on CUDA against int8 on the CPU; and offline `generate` with a
budget on a CUDA rank.

Tolerances. Streamed and resident products multiply the same weights by the same kernels with the same shapes, so
their logits agree to float32 rounding (1e-5). The Triton int8 product rounds the weight to the activations' dtype
as `Int8DequantKernel` does and sums in float32 in another order: 1e-5 relative in float32 (IEEE products, no
TF32); in bfloat16 the outputs themselves round to 8 bits of mantissa (~0.4%), so 2e-2 relative. int8 on CUDA
against int8 on the CPU: the same int8 numbers (quantized on each device in float64) with float32 activations, sums
in another order: logits within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

from shardmesh.core.dtypes import Quantization
from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import SamplingParams, Segment
from shardmesh.engine import host_offload, int8_cuda
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import ShardGroups, SingleRank
from shardmesh.engine.linear import Int8CudaKernel, Int8DequantKernel, quantize_groups
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from shardmesh.engine.offload import bytes_streamed, stats, streamer_of
from shardmesh.engine.stage import StageEngine
from shardmesh_cli.offline import OfflineRequest, generate_local
from tests.checkpoints import make_checkpoint

LAYERS = 8
PROMPT = [1, 17, 5, 42, 33, 8, 61, 12, 3]
STEPS = 12
CUDA = torch.device("cuda:0")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("q"), "qwen2-bias-tied", num_layers=LAYERS, hidden_size=128,
                           intermediate_size=256)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "out_f", "in_f"), [(1, 96, 64), (3, 4096, 4096), (16, 200, 1000), (5, 12000, 96)])
def test_triton_int8_product_matches_the_dequantized_product(rows: int, out_f: int, in_f: int,
                                                            dtype: torch.dtype) -> None:  # fmt: skip
    g = torch.Generator(device=CUDA).manual_seed(0)
    w = torch.randn(out_f, in_f, generator=g, device=CUDA) * 0.05
    q, s = quantize_groups(w)
    x = torch.randn(rows, in_f, generator=g, device=CUDA).to(dtype)
    want = Int8DequantKernel()(x, q, None, s)
    got = int8_cuda.linear(x, q, s)
    assert got.dtype == dtype
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * float(want.abs().max()))
    # a row-parallel slice: strided rows of values and of their groups' pairs
    half = in_f // 2 // 32 * 32 or in_f
    got = int8_cuda.linear(x[:, :half].contiguous(), q[:, :half], s[:, : -(-half // 32)])
    want = Int8DequantKernel()(x[:, :half], q[:, :half].contiguous(), None, s[:, : -(-half // 32)].contiguous())
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=rtol * float(want.abs().max()))


def run(model: Transformer, dtype: torch.dtype, graphs: bool) -> tuple[list[int], Tensor]:
    """Greedy tokens and their logits: the prompt, then `STEPS` decode steps (replayed from graphs with `graphs`)."""
    cache = model.make_cache(1, dtype, CUDA)
    spec = ShardSpec(0, LAYERS, LAYERS)
    engine = StageEngine(model, ShardGroups(spec, 0, 1, SingleRank(), None, None), cache, CUDA, cuda_graphs=graphs)
    out = engine.step(BatchLayout.build([Segment(0, 0, len(PROMPT))], CUDA), torch.tensor(PROMPT))[-1]
    tokens, logits, pos = [int(out.argmax())], [out], len(PROMPT)
    for _ in range(STEPS):
        out = engine.step(BatchLayout.build([Segment(0, pos, 1)], CUDA), torch.tensor(tokens[-1:]))[-1]
        tokens.append(int(out.argmax()))
        logits.append(out)
        pos += 1
    return tokens, torch.stack(logits).float()


def weight_bytes(model: Transformer) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale")
    )


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize(("dtype", "quant"), [(torch.float32, Quantization.NONE), (torch.bfloat16, Quantization.NONE),
                                              (torch.bfloat16, Quantization.INT8)])  # fmt: skip
def test_half_the_layers_streamed_from_pinned_memory_give_the_resident_output(
    ckpt: Path, dtype: torch.dtype, quant: Quantization, graphs: bool
) -> None:
    spec = ShardSpec(0, LAYERS, LAYERS)
    resident = build_shard(ckpt, spec, dtype=dtype, device=CUDA, progress=False, quantization=quant)
    full = weight_bytes(resident)
    want_tokens, want = run(resident, dtype, graphs)
    del resident
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    budget = full * 6 // 10
    streamed = build_shard(ckpt, spec, dtype=dtype, device=CUDA, progress=False, quantization=quant,
                           memory_budget=budget)  # fmt: skip
    held = torch.cuda.memory_allocated(CUDA) - before
    streamer = streamer_of(streamed)
    assert isinstance(streamer, host_offload.HostLayerStreamer)
    plan = streamer.plan
    assert len(plan.resident_layers) > 0 and len(plan.streamed_layers) >= LAYERS // 2
    assert "streamed-pinned" in streamed.linear_kernels
    rope = sum(t.numel() * t.element_size() for t in (streamed.rope_cos, streamed.rope_sin))
    assert held <= budget + rope, f"{held} B on the device against a budget of {budget} B"
    tokens, got = run(streamed, dtype, graphs)
    assert tokens == want_tokens
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    forwards = 1 + STEPS + (2 if graphs else 0)  # one graph: captured after two warm-up forwards, then replayed
    assert bytes_streamed(streamed) == forwards * plan.streamed_bytes_per_step
    s = stats(streamed)
    assert s is not None and s.bound_bytes_per_second > 1e9  # a PCIe or NVLink-C2C link: GB/s
    if not graphs:  # replayed copies carry no timers; eager ones do
        assert s.read_seconds > 0 and s.read_bytes >= forwards * plan.streamed_bytes_per_step


def test_int8_on_cuda_gives_int8_on_the_cpu(ckpt: Path) -> None:
    spec = ShardSpec(0, LAYERS, LAYERS)
    gpu = build_shard(ckpt, spec, dtype=torch.float32, device=CUDA, progress=False, quantization=Quantization.INT8)
    assert "int8-triton" in gpu.linear_kernels
    gpu_tokens, gpu_logits = run(gpu, torch.float32, graphs=True)
    cpu = build_shard(ckpt, spec, dtype=torch.float32, progress=False, quantization=Quantization.INT8)
    cache = cpu.make_cache(1, torch.float32, "cpu")
    ids, start, tokens, logits = PROMPT, 0, [], []
    with torch.inference_mode():
        for _ in range(STEPS + 1):
            out = cpu(torch.tensor(ids), BatchLayout.build([Segment(0, start, len(ids))]), cache)[-1]
            start += len(ids)
            ids = [int(out.argmax())]
            tokens.append(ids[0])
            logits.append(out)
    assert gpu_tokens == tokens
    torch.testing.assert_close(gpu_logits.cpu(), torch.stack(logits), atol=1e-3, rtol=0)


def test_offline_generate_with_a_budget_on_a_cuda_rank(ckpt: Path) -> None:
    request = OfflineRequest(PROMPT, STEPS, SamplingParams(temperature=0.0))
    want = generate_local(ckpt, request, 1, 1, "bfloat16", "cuda")
    full = weight_bytes(build_shard(ckpt, ShardSpec(0, LAYERS, LAYERS), dtype=torch.bfloat16, device=CUDA,
                                    progress=False))  # fmt: skip
    got = generate_local(ckpt, request, 1, 1, "bfloat16", "cuda", memory_budget=full // 2)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="too small"):
        generate_local(ckpt, request, 1, 1, "bfloat16", "cuda", memory_budget=full // 20)


def test_int8_cuda_kernel_is_chosen_and_reports_its_name() -> None:
    from shardmesh.engine.linear import choose_kernel

    assert isinstance(choose_kernel(torch.bfloat16, CUDA, quantized=True), Int8CudaKernel)
