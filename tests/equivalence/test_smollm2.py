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
