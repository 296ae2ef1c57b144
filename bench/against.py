"""This checkout against an earlier commit, in one run: did a change make serving slower?

    .venv/bin/python bench/against.py REV [--layouts 1x1,2x1] [--streams 1,16] [--dtype float32] [--rounds 3]
                                          [--prompt-tokens N] [--temperature T [--top-p P] [--top-k K]]
                                          [--frequency-penalty F] [--presence-penalty P] [--repetition-penalty R]
                                          [--top-logprobs N] [--kv-block-size N]

REV is checked out into a temporary git worktree (removed afterwards). For each layout, the two
checkouts' meshes (`shardmesh up`, same model, flags and threads) are started in turn, A B A B ...,
`--rounds` times each, and the same requests as bench/run.py are sent (one stream: the median of 3; N
streams: one burst). Alternating keeps slow drifts of the machine (another tenant, thermal state) from
landing on one side only. The table gives each side's median over its rounds and the ratio this / REV,
per figure: decode ms per token (below 1 is faster) and aggregate tokens/s (above 1 is faster).
`--prompt-tokens N` sends a longer prompt instead: bench/run.py's request repeated until its chat encoding holds N
tokens or more (for changes to prompts: their time to first token). `--temperature T` (above 0) sends sampled
requests instead of greedy ones, seeded and ignoring the end of sequence (for changes to sampling); the penalties add
theirs to those requests, or to greedy ones, and `--top-logprobs N` asks each token's N most likely alternatives.
`--kv-block-size N` starts both sides' meshes with a paged KV cache of blocks of N tokens (`up --kv-block-size`).

Writes bench/results/<host>-<date>-against-<rev>.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)
from bench.run import MAX_CONTEXT, Mesh, run_streams  # noqa: E402
from shardmesh.core.step import MAX_TOP_LOGPROBS  # noqa: E402
from shardmesh.rpc.procs import cores  # noqa: E402
from shardmesh_cli.up import share_cores  # noqa: E402

if TYPE_CHECKING:
    from shardmesh.models.tokenizer import Tokenizer

FIGURES = (
    ("ms_per_token", "decode ms/token", "lower"),
    ("aggregate_tok_s", "aggregate tok/s", "higher"),
    ("ttft_ms", "time to first token, ms", "lower"),
)


def long_prompt(tokenizer: Tokenizer, tokens: int) -> list[int]:
    """bench/run.py's chat request, its text repeated until the encoding holds `tokens` tokens or more (once for 0)."""
    for repeats in range(1, tokens + 2):
        ids = tokenizer.encode_chat([{"role": "user", "content": " ".join([PROMPT] * repeats)}])
        if len(ids) >= tokens:
            return ids
    raise AssertionError("unreachable: every repeat adds a token")


@contextlib.contextmanager
def checked_out(rev: str, into: Path) -> Iterator[str]:
    """`rev` checked out at `into` (a git worktree) for the block, removed after it however the block ends; yields the
    full commit id."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(into), commit], check=True)
    try:
        yield commit
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(into)], check=False)


def measure(tree: Path, model_dir: Path, pp: int, tp: int, streams: list[int], prompt_ids: list[int],
            new_tokens: int, dtype: str, sampling: dict | None = None,
            block_size: int = 0) -> dict[int, dict]:  # fmt: skip
    share = share_cores(pp, tp, "cpu", "auto", None, cores())
    paged = ("--kv-block-size", str(block_size)) if block_size else ()
    with tempfile.TemporaryDirectory() as logs:
        mesh = Mesh(model_dir, pp, tp, share.pipeline, max(streams), Path(logs), share.worker_threads, "none", tree,
                    extra=("--dtype", dtype, *paged))  # fmt: skip
        try:
            return {n: run_streams(mesh.address, prompt_ids, new_tokens, n, sampling=sampling) for n in streams}
        finally:
            mesh.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the commit to compare against, e.g. HEAD~3 or a hash")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--layouts", default="1x1,2x1", help="pp x tp pairs")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=3, help="meshes started per checkout and layout, alternating")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of at least this many tokens (default: "
                    "bench/run.py's, ~46)")  # fmt: skip
    ap.add_argument("--temperature", type=float, default=0.0, help="sampled requests (seeded, ignoring the end of "
                    "sequence) at this temperature; 0, the default, is greedy")  # fmt: skip
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--top-logprobs", type=int, default=0, help="alternatives asked for each token (0 to 20)")
    ap.add_argument("--kv-block-size", type=int, default=0, help="a paged KV cache of blocks of this many tokens")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    if a.temperature < 0 or not 0 < a.top_p <= 1 or a.top_k < 0:
        ap.error(f"--temperature >= 0, --top-p in (0, 1], --top-k >= 0: got {a.temperature}, {a.top_p}, {a.top_k}")
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k, "seed": 7} if a.temperature else None
    if penalised(a):
        sampling = {**(sampling or {}), "frequency_penalty": a.frequency_penalty,
                    "presence_penalty": a.presence_penalty, "repetition_penalty": a.repetition_penalty}  # fmt: skip
    if not 0 <= a.top_logprobs <= MAX_TOP_LOGPROBS:
        ap.error(f"--top-logprobs: 0 to {MAX_TOP_LOGPROBS}, got {a.top_logprobs}")
    if a.top_logprobs:
        sampling = {**(sampling or {}), "top_logprobs": a.top_logprobs}
    if a.prompt_tokens < 0 or a.prompt_tokens + a.new_tokens > MAX_CONTEXT:
        ap.error(f"--prompt-tokens: 0 to {MAX_CONTEXT} less --new-tokens ({a.new_tokens}), got {a.prompt_tokens}")

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = long_prompt(Tokenizer.from_dir(model_dir), a.prompt_tokens)
    a.prompt_len = len(prompt_ids)
    streams = [int(s) for s in a.streams.split(",")]
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in a.layouts.split(",")]
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "against"
        with checked_out(a.rev, other) as commit:
            rows = []
            for pp, tp in layouts:
                runs: dict[str, list[dict[int, dict]]] = {"this": [], "rev": []}
                for i in range(a.rounds):
                    for side, tree in (
                        (("this", ROOT), ("rev", other)) if i % 2 == 0 else (("rev", other), ("this", ROOT))
                    ):
                        runs[side].append(measure(tree, model_dir, pp, tp, streams, prompt_ids, a.new_tokens, a.dtype,
                                                  sampling, a.kv_block_size))  # fmt: skip
                        print(f"pp={pp} tp={tp} {side} round {i}: {runs[side][-1]}", file=sys.stderr)
                for n in streams:
                    row = {"pp": pp, "tp": tp, "streams": n}
                    for key, _, _ in FIGURES:
                        mine = statistics.median(r[n][key] for r in runs["this"])
                        theirs = statistics.median(r[n][key] for r in runs["rev"])
                        row[key] = {"this": mine, "rev": theirs, "ratio": mine / theirs}
                    rows.append(row)
    report(info, commit, rows, a)


def report(info: dict, commit: str, rows: list[dict], a: argparse.Namespace) -> None:
    lines = [
        f"## This checkout against {commit[:7]} — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"{info['date']}",
        "",
        f"Model `{a.model}` {a.dtype}, {drawn(a)}, a prompt of {a.prompt_len} tokens, {a.new_tokens} new tokens"
        f"{f', a paged KV cache of blocks of {a.kv_block_size}' if a.kv_block_size else ''}; "
        f"each side's median over {a.rounds} meshes "
        "started in turn (A B A B ...). Ratio = this ÷ REV: below 1 is faster for ms/token and time to first token "
        "(TTFT), above 1 for tok/s.",
        "",
        "| pp | tp | streams | ms/token this | ms/token REV | ratio | tok/s this | tok/s REV | ratio | TTFT ms this "
        "| TTFT ms REV | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r[key]['this']:.1f} | {r[key]['rev']:.1f} | {r[key]['ratio']:.3f}" for key, _, _ in FIGURES]
        lines.append(f"| {r['pp']} | {r['tp']} | {r['streams']} | {' | '.join(cells)} |")
    md = "\n".join(lines) + "\n"
    # The dtype and the sampling in the name: runs of both against one commit on one day would overwrite each other.
    sampled = f"-t{a.temperature:g}-p{a.top_p:g}-k{a.top_k}" if a.temperature else ""
    if penalised(a):
        sampled += f"-f{a.frequency_penalty:g}-pr{a.presence_penalty:g}-r{a.repetition_penalty:g}"
    if a.top_logprobs:
        sampled += f"-lp{a.top_logprobs}"
    if a.kv_block_size:
        sampled += f"-paged{a.kv_block_size}"
    save_results(Path(a.out), info, f"-against-{commit[:7]}-{a.dtype}{sampled}", md,
                 {"against": commit, "dtype": a.dtype, "prompt_tokens": a.prompt_len, "sampling": drawn(a),
                  "rows": rows})  # fmt: skip


def penalised(a: argparse.Namespace) -> bool:
    return bool(a.frequency_penalty or a.presence_penalty or a.repetition_penalty != 1.0)


def drawn(a: argparse.Namespace) -> str:
    """How the requests drew their tokens, in words."""
    penalties = (f", frequency penalty {a.frequency_penalty:g}, presence penalty {a.presence_penalty:g}, repetition "
                 f"penalty {a.repetition_penalty:g}" if penalised(a) else "")  # fmt: skip
    if a.top_logprobs:
        penalties += f", {a.top_logprobs} top logprobs a token"
    if not a.temperature:
        return f"greedy{penalties} (ignoring EOS)" if penalties else "greedy"
    return (f"sampled (temperature {a.temperature:g}, top-p {a.top_p:g}, top-k {a.top_k}{penalties}, seeded, "
            f"ignoring EOS)")  # fmt: skip


if __name__ == "__main__":
    main()
