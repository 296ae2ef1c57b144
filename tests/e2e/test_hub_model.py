"""A model named by its Hugging Face id, served from a hub cache built in tmp with no network (`HF_HUB_OFFLINE=1`):
`shardmesh generate --model ORG/NAME@REVISION` over real processes (the workers read the snapshot's symlinks into
the blobs) gives `transformers`' greedy tokens and logprobs for that revision's weights, not main's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.checkpoints import load_reference, make_checkpoint
from tests.hub_cache import add_revision, commit_of

PROMPT = [1, 17, 5, 42, 33, 8]


@torch.no_grad()
def reference(model_dir: Path, n: int) -> tuple[list[int], list[float]]:
    """`transformers`' greedy tokens and their logprobs."""
    out = load_reference(model_dir).generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                                             output_scores=True, return_dict_in_generate=True,
                                             pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]


def test_generate_by_hub_id_and_revision_matches_transformers(tmp_path: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    main = make_checkpoint(tmp_path / "main", "llama-gqa-tied", num_layers=4, seed=5)
    v1 = make_checkpoint(tmp_path / "v1", "llama-gqa-tied", num_layers=4, seed=6)
    add_revision(cache, "tiny-org/tiny-llama", main, commit_of("main"), refs=("main",))
    add_revision(cache, "tiny-org/tiny-llama", v1, commit_of("v1"), refs=("v1",))
    n = 8
    expected, other = reference(v1, n), reference(main, n)
    assert max(abs(a - b) for a, b in zip(expected[1], other[1], strict=True)) > 1e-2, "the revisions must differ"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "shardmesh_cli", "generate", "--model", "tiny-org/tiny-llama@v1", "--pp",
                        "2", "--token-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", str(n), "--json"],
                       capture_output=True, text=True, timeout=180, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == expected[0]
    assert max(abs(a - b) for a, b in zip(out["logprobs"], expected[1], strict=True)) < 1e-4
