"""`shardmesh generate --json` over real processes (Gloo on 127.0.0.1) against `transformers.generate`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import load_reference, make_checkpoint

PROMPT = [1, 17, 5, 42, 33, 8]


def shardmesh(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardmesh_cli", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=5, seed=3)


def hf_generate(model_dir: Path, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ref = load_reference(model_dir)
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_scores=True, return_dict_in_generate=True,
        pad_token_id=0,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


@pytest.mark.parametrize("pp,tp", [(2, 1), (1, 2), (2, 2), (3, 1)])
def test_json_contract_matches_transformers(tiny: Path, pp: int, tp: int) -> None:
    n = 12
    ref_tokens, ref_logprobs = hf_generate(tiny, PROMPT, n)
    r = shardmesh(
        "generate", "--model", str(tiny), "--pp", str(pp), "--tp", str(tp), "--token-ids", ",".join(map(str, PROMPT)),
        "--max-new-tokens", str(n), "--temperature", "0", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, f"stdout must hold exactly one JSON object, got: {r.stdout!r}"
    out = json.loads(lines[0])
    assert set(out) == {"token_ids", "logprobs", "text", "finish_reason"}
    assert out["token_ids"] == ref_tokens
    assert out["text"] == ""  # no tokenizer in this checkpoint
    assert out["finish_reason"] == ("stop" if ref_tokens[-1] == 2 else "length")
    assert max(abs(a - b) for a, b in zip(out["logprobs"], ref_logprobs, strict=True)) < 1e-4


def test_finish_reason_stop_on_eos(tiny: Path) -> None:
    """Make the model's first greedy choice the end-of-sequence id and check we stop there."""
    ref_tokens, _ = hf_generate(tiny, PROMPT, 1)
    cfg_path = tiny.parent / "eos"
    cfg_path.mkdir()
    for f in tiny.iterdir():
        (cfg_path / f.name).symlink_to(f)
    (cfg_path / "config.json").unlink()
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["eos_token_id"] = ref_tokens[0]
    (cfg_path / "config.json").write_text(json.dumps(cfg))
    r = shardmesh("generate", "--model", str(cfg_path), "--pp", "2", "--token-ids", ",".join(map(str, PROMPT)),
                  "--max-new-tokens", "8", "--json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == ref_tokens[:1] and out["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tp", "3"], "tensor parallel degree 3 must divide num_attention_heads=4"),
        (["--pp", "9"], "cannot split 5 layers over 9 stages"),
        (["--token-ids", "1,2,500"], "--token-ids: [500] outside the vocabulary [0, 96)"),
        (["--token-ids", "1,x"], "--token-ids: expected comma-separated integers"),
        (["--max-new-tokens", "0"], "--max-new-tokens: must be > 0"),
        (["--max-new-tokens", "1000"], "exceeds the model context of 256 tokens"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    ],
)
def test_bad_input_gets_one_clear_line(tiny: Path, args: list[str], message: str) -> None:
    base = {"--token-ids": "1,2,3", "--max-new-tokens": "4"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    flat = [x for kv in base.items() for x in kv if kv[0] not in args[::2]] + args
    r = shardmesh("generate", "--model", str(tiny), *flat, "--json", timeout=60)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


def test_prompt_without_tokenizer_is_refused(tiny: Path) -> None:
    r = shardmesh("generate", "--model", str(tiny), "hello", "--json", timeout=60)
    assert r.returncode != 0 and "has no tokenizer.json: pass --token-ids" in r.stderr
