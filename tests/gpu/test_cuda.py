"""The CUDA paths against `transformers` on the same GPU: offline `generate` and a whole `shardmesh up` mesh, with one
CUDA worker (pp=1) and with a CUDA stage next to a CPU stage (pp=2: activations staged through host memory, Gloo on
that link), float32 and bfloat16, with decode steps replayed from CUDA graphs (the default on CUDA).

Tolerances. float32: the same products in another order (qkv stacked, gate/up stacked): ~1e-6 relative, so tokens
must be identical and logprobs within 1e-3. bfloat16: every product rounds to 8 bits of mantissa (~0.4% relative)
and the two implementations round at different places (our rope and norms in float32, transformers' rope in
bfloat16), so a logprob moves by up to ~0.1 on these random models; tokens must agree wherever transformers' top two
are more than 0.2 apart, and logprobs within 0.25 there. A CPU stage of a mixed pipeline computes in float32 (bfloat16
on a CPU is emulated) only when float32 is asked, so mixed pipelines are checked in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardmesh.core.step import SamplingParams
from shardmesh_cli.offline import OfflineRequest, generate_local
from tests.checkpoints import make_checkpoint
from tests.meshes import Mesh

PROMPT = [1, 17, 5, 42, 33, 8, 61, 12, 3]
STEPS = 32
FAMILIES = ["llama31-rope-scaling", "qwen2-bias-tied", "mistral-gqa"]
TOL = {"float32": (1e-3, 0.0), "bfloat16": (0.25, 0.2)}  # (logprob tolerance, top-two margin below which a flip is ok)


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(request.param), request.param, num_layers=4)


@torch.inference_mode()
def reference(model_dir: Path, dtype: str, steps: int = STEPS) -> tuple[list[int], list[float], list[float]]:
    """transformers on cuda:0, greedy: tokens, their logprobs, and the margin between the top two at each step."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda:0").eval()
    out = m(torch.tensor([PROMPT], device="cuda:0"), use_cache=True)
    past, tokens, logprobs, margins = out.past_key_values, [], [], []
    for _ in range(steps):
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        top = lp.topk(2)
        tokens.append(int(top.indices[0]))
        logprobs.append(float(top.values[0]))
        margins.append(float(top.values[0] - top.values[1]))
        out = m(torch.tensor([[tokens[-1]]], device="cuda:0"), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens, logprobs, margins


def assert_matches(tokens: list[int], logprobs: list[float], dtype: str, ref) -> None:
    ref_tokens, ref_logprobs, margins = ref
    tol, margin = TOL[dtype]
    for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        if margins[i] <= margin:
            return  # a near-tie: from here on the two may rightly continue differently
        assert t == ref_tokens[i], f"step {i}: token {t} != transformers' {ref_tokens[i]} (margin {margins[i]:.3f})"
        assert abs(lp - ref_logprobs[i]) <= tol, f"step {i}: logprob {lp} vs {ref_logprobs[i]}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offline_one_cuda_worker(checkpoint: Path, dtype: str) -> None:
    r = generate_local(checkpoint, OfflineRequest(PROMPT, STEPS, SamplingParams(temperature=0.0)), 1, 1, dtype, "cuda")
    assert_matches(r.token_ids, r.logprobs, dtype, reference(checkpoint, dtype))


def test_offline_cuda_stage_then_cpu_stage(checkpoint: Path) -> None:
    r = generate_local(checkpoint, OfflineRequest(PROMPT, STEPS, SamplingParams(temperature=0.0)), 2, 1, "float32",
                       "cuda:0,cpu")  # fmt: skip
    assert_matches(r.token_ids, r.logprobs, "float32", reference(checkpoint, "float32"))


def _mesh_generate(model_dir: Path, pp: int, device: str, dtype: str, log_dir: Path,
                   *extra: str) -> tuple[list[int], list[float]]:  # fmt: skip
    from shardmesh.proto.v1 import gateway_pb2

    mesh = Mesh(model_dir, pp, 1, log_dir, "--device", device, "--dtype", dtype, *extra)
    try:
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=PROMPT), request_id="gpu",
            params=gateway_pb2.SamplingParams(max_new_tokens=STEPS, temperature=0.0),
        )  # fmt: skip
        r = mesh.stub.Generate(req, timeout=300)
        return list(r.token_ids), list(r.logprobs)
    finally:
        mesh.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mesh_one_cuda_worker(checkpoint: Path, dtype: str, tmp_path: Path) -> None:
    tokens, logprobs = _mesh_generate(checkpoint, 1, "cuda", dtype, tmp_path)
    assert_matches(tokens, logprobs, dtype, reference(checkpoint, dtype))


@pytest.mark.parametrize("pipeline", ["auto", "turns"])
def test_mesh_cuda_stage_then_cpu_stage(checkpoint: Path, pipeline: str, tmp_path: Path) -> None:
    """`auto` keeps a pipeline with a GPU stage full: one decode step per call. `turns` keeps one step in flight, so
    the gateway asks for several steps per call and the CPU stage sends each drawn token back to the CUDA stage over
    the loop link, a shared-memory ring in host memory (`groups.form_loop`)."""
    tokens, logprobs = _mesh_generate(checkpoint, 2, "cuda,cpu", "float32", tmp_path, "--pipeline", pipeline)
    assert_matches(tokens, logprobs, "float32", reference(checkpoint, "float32"))
    logs = [w.read_text() for w in sorted(tmp_path.glob("worker*.log"))]
    assert any("gloo" in text for text in logs), "the CUDA-CPU link should be formed over Gloo"
    ready = [[json.loads(line) for line in text.splitlines() if line.startswith("{") and '"event": "ready"' in line]
             for text in logs]  # fmt: skip
    loops = [lines[-1].get("loop_link") for lines in ready]
    assert loops == ["shm direct (cpu <-> cpu)"] * 2, loops  # both ends of the loop, in host memory
