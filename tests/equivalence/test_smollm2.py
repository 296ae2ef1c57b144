"""The real default model, SmolLM2-135M-Instruct, split over two stage processes, against transformers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardmesh.models.registry import resolve
from shardmesh.models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPT = "Write a short poem about a lighthouse keeper."


@pytest.fixture(scope="module")
def smollm2():
    return resolve("smollm2-135m-instruct")


def test_pp2_greedy_equals_transformers(smollm2) -> None:
    from transformers import AutoModelForCausalLM

    n = 32
    ids = Tokenizer.from_dir(smollm2).encode_chat([{"role": "user", "content": PROMPT}])
    ref = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)  # fmt: skip
    ref_tokens = out.sequences[0, len(ids) :].tolist()
    ref_logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ref_tokens, strict=True)]
    assert len(ref_tokens) == n, "pick a prompt whose answer is longer than the comparison"
    del ref

    r = subprocess.run(
        [sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(smollm2), "--pp", "2", PROMPT,
         "--max-new-tokens", str(n), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["token_ids"] == ref_tokens
    assert max(abs(a - b) for a, b in zip(got["logprobs"], ref_logprobs, strict=True)) < 1e-3
    assert got["text"] and got["finish_reason"] == "length"


# -- int8 weights ---------------------------------------------------------------------------------------------------


def _teacher_forced_logprobs(model_dir, ids: list[int], quantization) -> torch.Tensor:
    """The log-probability of each next token of `ids`, the text fed whole (one prefill, every position's logits)."""
    from shardmesh.core.layout import ShardSpec
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout
    from shardmesh.engine.loader import build_shard

    model = build_shard(model_dir, ShardSpec(0, 30, 30), max_len=len(ids), progress=False, quantization=quantization)
    with torch.inference_mode():
        logits = model(torch.tensor(ids), BatchLayout.build([Segment(0, 0, len(ids))]),
                       model.make_cache(1, model.dtype, "cpu"), all_logits=True)  # fmt: skip
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_int8_teacher_forced_against_float32(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,048 tokens of ordinary technical prose (Python's own documentation topics, shipped with every Python,
    `bench.int8_quality.gate_ids`), teacher-forced through float32 and int8 shards of SmolLM2: the issue's gates,
    mean |Δ logprob| at most 0.03 nats and perplexity ratio at most 1.02.

    Measured (README, "int8 weights"; bench/int8_quality.py): 0.0026 nats, ratio 1.0001. SmolLM2's layers came from a
    Q4_1 GGUF, which int8 groups of 32 hold up to their float16 scales; one scale per output row lost 0.051 nats."""
    from bench.int8_quality import gate_ids
    from shardmesh.core.dtypes import Quantization

    # The same numbers as the kernel chosen (float32 activations), faster for a 2,048-token prefill.
    monkeypatch.setenv("SHARDMESH_LINEAR_KERNEL", "int8-dequant")
    ids = gate_ids(Tokenizer.from_dir(smollm2))
    ref = _teacher_forced_logprobs(smollm2, ids, Quantization.NONE)
    got = _teacher_forced_logprobs(smollm2, ids, Quantization.INT8)
    ppl_ratio = torch.exp(-got.mean()) / torch.exp(-ref.mean())
    assert ppl_ratio <= 1.02
    assert (got - ref).abs().mean() <= 0.03


def test_int8_greedy_chat_answers_against_float32(smollm2) -> None:
    """Greedy 64-token answers to the 10 chat prompts of `bench.int8_quality.CHAT_PROMPTS`, int8 (the kernels
    chosen) against float32: the issue asks for at least 8 of 10 identical. Measured: 10 (one scale per output row
    gave 3; llama.cpp Q8_0 against its F32 4)."""
    from bench.int8_quality import CHAT_PROMPTS, greedy
    from shardmesh.core.dtypes import Quantization
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.loader import build_shard

    tok = Tokenizer.from_dir(smollm2)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    answers = {}
    for q in (Quantization.NONE, Quantization.INT8):
        model = build_shard(smollm2, ShardSpec(0, 30, 30), max_len=256, progress=False, quantization=q)
        answers[q] = greedy(model, prompts)
        del model
    identical = sum(a == b for a, b in zip(answers[Quantization.INT8], answers[Quantization.NONE], strict=True))
    print(f"int8 greedy answers identical to float32: {identical} of {len(prompts)}")
    assert identical >= 8


def _generate(smollm2, *flags: str, env: dict | None = None) -> dict:
    import os

    r = subprocess.run(
        [sys.executable, "-m", "shardmesh_cli", "generate", "--model", str(smollm2), PROMPT, "--max-new-tokens", "32",
         "--quantize", "int8", "--json", *flags],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_int8_is_the_same_at_every_layout(smollm2) -> None:
    """int8 weights hold the same numbers at every (pp, tp) (groups of 32 inputs, and SmolLM2's row-parallel slices
    hold whole groups: 192 and 512 inputs at tp=3) and the kernel chosen keeps activations in float32, so every
    layout computes what pp=1 tp=1 does, to float32 rounding (SmolLM2's heads split by 3)."""
    one = _generate(smollm2)
    for flags in (("--tp", "3"), ("--pp", "2")):
        got = _generate(smollm2, *flags)
        assert got["token_ids"] == one["token_ids"], flags
        assert max(abs(a - b) for a, b in zip(got["logprobs"], one["logprobs"], strict=True)) < 1e-3, flags
