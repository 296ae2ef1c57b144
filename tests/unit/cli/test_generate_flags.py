"""`shardmesh generate`'s usage errors come before torch is imported, so a mistyped flag is answered at once rather
than after the ~1.5 s that importing torch takes on a 2-core CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Each case: the flags after `generate --model M` (a model of 96 tokens and a context of 256), and the start of the
# one line it prints.
CASES = [
    (["--token-ids", "1,2,500"], "error: --token-ids: [500] outside the vocabulary [0, 96)"),
    (["--token-ids", "1,x"], "error: --token-ids: expected comma-separated integers"),
    (["--token-ids", "1", "--max-new-tokens", "0"], "error: --max-new-tokens: must be > 0"),
    (
        ["--token-ids", "1,2", "--max-new-tokens", "255"],
        "error: --max-new-tokens: prompt (2) + max_new_tokens (255) exceeds the model context of 256 tokens",
    ),
    (["--token-ids", "1", "--temperature", "-1"], "error: --temperature: temperature must be >= 0"),
    (["--token-ids", "1", "--top-p", "1.5"], "error: --top-p: top_p must be in (0, 1]"),
    (["--token-ids", "1", "--memory-budget", "lots"], "error: --memory-budget: expected a size like 24GiB"),
    (["--token-ids", "1", "--kv-block-size", "-1"], "error: --kv-block-size: must be >= 0"),
    (["--token-ids", "1", "--stop", "x"], "error: --stop: stop strings need --gateway"),
    (["--token-ids", "1", "--pp", "2", "--device", "cpu,cpu,cpu"], "error: --device"),
    ([], "error: a PROMPT or --token-ids is required"),
]

SCRIPT = """
import contextlib, io, json, sys
from shardmesh_cli.main import main
out = []
for flags in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["generate", "--model", sys.argv[2], *flags])
    out.append([rc, err.getvalue(), "torch" in sys.modules])
print(json.dumps(out))
"""


def test_usage_errors_come_before_torch_is_imported(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 96, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }))  # fmt: skip
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([flags for flags, _ in CASES]), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for (flags, message), (rc, err, torch_imported) in zip(CASES, json.loads(r.stdout), strict=True):
        assert rc == 2 and err.startswith(message) and err.count("\n") == 1, (flags, rc, err)
        assert not torch_imported, f"{flags}: torch was imported before the usage error"
