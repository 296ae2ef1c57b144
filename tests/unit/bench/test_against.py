"""bench/against.py's report (no mesh is started: the rows are made up, so each cell can be checked by hand)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from bench import against


def test_report_names_the_dtype_and_gives_every_figure(tmp_path: Path) -> None:
    """Runs of two dtypes, and of sampled requests, against one commit on one day go to files of their own, and the
    table has time to first token beside decode ms/token and tokens/s, each with this ÷ REV."""
    info = {"host": "vm", "date": "2026-11-29T06:00:00+00:00", "cpu": "cpu", "cores": 2, "torch": "2.13.0"}
    rows = [{"pp": 1, "tp": 1, "streams": 16, "ms_per_token": {"this": 30.0, "rev": 32.0, "ratio": 30 / 32},
             "aggregate_tok_s": {"this": 400.0, "rev": 360.0, "ratio": 400 / 360},
             "ttft_ms": {"this": 54.0, "rev": 77.0, "ratio": 54 / 77}}]  # fmt: skip
    for dtype in ("float32", "bfloat16"):
        for temperature, top_p in ((0.0, 1.0), (0.7, 0.9)):
            args = argparse.Namespace(model="m", dtype=dtype, new_tokens=64, rounds=3, out=str(tmp_path),
                                      prompt_len=46, temperature=temperature, top_p=top_p, top_k=0,
                                      frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                                      top_logprobs=0, kv_block_size=0)  # fmt: skip
            against.report(info, "f40302c" + "0" * 33, rows, args)
    args.frequency_penalty, args.repetition_penalty = 0.5, 1.1  # bfloat16, sampled, and penalised
    against.report(info, "f40302c" + "0" * 33, rows, args)
    args.top_logprobs = 5  # and asking for alternatives
    against.report(info, "f40302c" + "0" * 33, rows, args)
    args.kv_block_size = 16  # and on paged meshes
    against.report(info, "f40302c" + "0" * 33, rows, args)
    stems = ["bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1", "bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1-lp5",
             "bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1-lp5-paged16",
             "bfloat16-t0.7-p0.9-k0", "bfloat16", "float32-t0.7-p0.9-k0", "float32"]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"vm-2026-11-29-against-f40302c-{stem}.{ext}" for stem in stems for ext in ("json", "md")
    )
    sampled = (tmp_path / "vm-2026-11-29-against-f40302c-float32-t0.7-p0.9-k0.md").read_text()
    assert "float32, sampled (temperature 0.7, top-p 0.9, top-k 0, seeded, ignoring EOS), a prompt" in sampled
    penalised = (tmp_path / "vm-2026-11-29-against-f40302c-bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1.md").read_text()
    assert ("top-k 0, frequency penalty 0.5, presence penalty 0, repetition penalty 1.1, seeded, ignoring EOS"
            in penalised)  # fmt: skip
    alternatives = (tmp_path / "vm-2026-11-29-against-f40302c-bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1-lp5.md").read_text()
    assert "repetition penalty 1.1, 5 top logprobs a token, seeded, ignoring EOS" in alternatives
    assert ", a paged KV cache of blocks of" not in alternatives
    paged = (tmp_path / "vm-2026-11-29-against-f40302c-bfloat16-t0.7-p0.9-k0-f0.5-pr0-r1.1-lp5-paged16.md").read_text()
    assert "64 new tokens, a paged KV cache of blocks of 16; each side's median" in paged
    md = (tmp_path / "vm-2026-11-29-against-f40302c-bfloat16.md").read_text()
    assert "| 1 | 1 | 16 | 30.0 | 32.0 | 0.938 | 400.0 | 360.0 | 1.111 | 54.0 | 77.0 | 0.701 |" in md
    assert "Model `m` bfloat16, greedy, a prompt of 46 tokens" in md
    data = json.loads((tmp_path / "vm-2026-11-29-against-f40302c-bfloat16.json").read_text())
    assert data["dtype"] == "bfloat16" and data["rows"] == rows and data["prompt_tokens"] == 46


class _Words:
    """A tokenizer whose chat encoding is 5 tokens of template and one per word of each message."""

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return [0] * 5 + [1] * sum(len(m["content"].split()) for m in messages)


def test_a_long_prompt_repeats_the_request_until_it_holds_the_tokens_asked_for() -> None:
    once = len(against.PROMPT.split()) + 5  # bench/run.py's request as it is
    assert len(against.long_prompt(_Words(), 0)) == once  # type: ignore[arg-type]
    assert len(against.long_prompt(_Words(), once)) == once  # type: ignore[arg-type]
    ids = against.long_prompt(_Words(), 300)  # type: ignore[arg-type]
    assert 300 <= len(ids) < 300 + len(against.PROMPT.split())  # the fewest repeats that reach it


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(against.ROOT), "worktree", "list", "--porcelain"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip


def test_a_checked_out_revision_is_there_for_the_block_and_gone_after_it_however_the_block_ends(tmp_path: Path) -> None:
    """The benches that compare against REV run its processes from a worktree: it holds REV's files for the block and
    is removed from disk and from git's list afterwards, when the block raises too."""
    head = subprocess.run(["git", "-C", str(against.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    tree = tmp_path / "rev"
    with against.checked_out("HEAD", tree) as commit:
        assert commit == head
        assert (tree / "bench" / "against.py").is_file() and str(tree) in _worktrees()
    assert not tree.exists() and str(tree) not in _worktrees()
    with pytest.raises(RuntimeError, match="a bench failed"), against.checked_out("HEAD", tree):
        assert tree.is_dir()
        raise RuntimeError("a bench failed")
    assert not tree.exists() and str(tree) not in _worktrees()
