"""The last stage's draws: `sampling.sample` of this checkout against an earlier commit's, in one process.

    .venv/bin/python bench/sampling.py [--against REV] [--rows 1,16] [--calls 40] [--rounds 5] [--out DIR]

Each setting (greedy, temperature alone, top-p, top-k, min-p, the penalties) samples random logits of SmolLM2's
vocabulary (49152, standard normal × 3) for 1 and 16 rows, seeded, at successive positions, as a worker's last stage
does once per decode step; each row's sequence holds 600 random tokens before the draw (what the penalties count).
REV's `shardmesh/engine/sampling.py` and `penalties.py` are read from git and loaded beside this checkout's; both
call this checkout's compiled kernels, loaded first (`greedy_rows`, and `sample_rows` where this checkout has it), on
PyTorch's threads as a worker sets them. The two are timed in turn, `--rounds` times each (A B A B ...), `--calls`
calls a round; the table gives each one's median ms per call and the ratio this ÷ REV.

Writes <out>/<host>-<date>-sampling-against-<rev>.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402
from shardmesh.core.step import SamplingParams  # noqa: E402
from shardmesh.engine import cpu_kernels  # noqa: E402

VOCAB = 49152
SETTINGS = {
    "greedy": {},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1, top-k 50": {"temperature": 1.0, "top_k": 50},
    "temperature 1, min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
    "temperature 0.7, top-p 0.9, repetition 1.1": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
    "temperature 0.7, top-p 0.9, frequency and presence 0.5": {
        "temperature": 0.7, "top_p": 0.9, "frequency_penalty": 0.5, "presence_penalty": 0.5},
}  # fmt: skip
HISTORY = 600  # tokens each row's sequence holds before the draw


def sampling_of(rev: str, into: Path) -> tuple[str, ModuleType]:
    """REV's full commit id and its sampling module, loaded from its file under another name, over REV's penalties."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    penalties = _load(commit, "penalties", into)
    ours = sys.modules["shardmesh.engine.penalties"]
    sys.modules["shardmesh.engine.penalties"] = penalties  # what REV's sampling imports, while it loads
    try:
        return commit, _load(commit, "sampling", into)
    finally:
        sys.modules["shardmesh.engine.penalties"] = ours


def _load(commit: str, name: str, into: Path) -> ModuleType:
    """shardmesh/engine/<name>.py at `commit`, loaded as <name>_rev."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:shardmesh/engine/{name}.py"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = into / f"{name}_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"{name}_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(sample: Callable, logits: torch.Tensor, params: list[SamplingParams], calls: int, first: int,
          history: object) -> float:  # fmt: skip
    """ms per call of `calls` calls, each at the next position after the history's tokens (the same ones each round,
    so that the penalties count as many tokens in every round)."""
    rows = logits.shape[0]
    t0 = time.perf_counter()
    for c in range(calls):
        sample(logits, params, [HISTORY + first + c] * rows, history, list(range(rows)))
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="HEAD", help="the commit to compare against (default HEAD)")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    if not cpu_kernels.available():
        sys.exit(f"bench/sampling.py: the compiled kernels did not build: {cpu_kernels.build_error()}")
    torch.set_num_threads(a.threads)
    from shardmesh.engine import sampling

    rows_list = [int(r) for r in a.rows.split(",")]
    from shardmesh.engine.penalties import TokenHistory

    logits = torch.randn(max(rows_list), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    history = TokenHistory(max(rows_list), HISTORY + a.calls + 2)
    tokens = torch.randint(0, VOCAB, (max(rows_list), HISTORY), generator=torch.Generator().manual_seed(1))
    for slot, row in enumerate(tokens.tolist()):
        history.record([slot] * HISTORY, list(range(HISTORY)), row)
    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        commit, theirs = sampling_of(a.against, Path(tmp))
        results = []
        for name, fields in SETTINGS.items():
            params = SamplingParams(**fields, seed=7 if fields else None, prompt_len=HISTORY // 2)
            for rows in rows_list:
                x, ps = logits[:rows].contiguous(), [params] * rows
                sides = {"this": sampling.sample, "rev": theirs.sample}
                times: dict[str, list[float]] = {"this": [], "rev": []}
                for sample in sides.values():  # a warm-up call each
                    timed(sample, x, ps, 2, 0, history)
                for r in range(a.rounds):
                    for side in ("this", "rev") if r % 2 == 0 else ("rev", "this"):
                        times[side].append(timed(sides[side], x, ps, a.calls, 0, history))
                this, rev = statistics.median(times["this"]), statistics.median(times["rev"])
                results.append({"setting": name, "rows": rows, "this_ms": this, "rev_ms": rev, "ratio": this / rev,
                                "rounds": times})  # fmt: skip
                print(f"{name}, {rows} rows: {this:.3f} / {rev:.3f} ms", file=sys.stderr)
    lines = [
        f"## `sampling.sample` against {commit[:7]} — {info['cpu']}, {a.threads} threads, torch {info['torch']}, "
        f"{info['date']}",
        "",
        f"Random logits (standard normal × 3) of {VOCAB} tokens, seeded draws at successive positions after "
        f"{HISTORY} random tokens (half of them the prompt's); each side's "
        f"median over {a.rounds} rounds of {a.calls} calls, taken in turn; both sides on this checkout's kernels.",
        "",
        "| setting | rows | ms a call, this | ms a call, REV | this ÷ REV |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['setting']} | {r['rows']} | {r['this_ms']:.3f} | {r['rev_ms']:.3f} | {r['ratio']:.3f} |"
              for r in results]  # fmt: skip
    save_results(a.out, info, f"-sampling-against-{commit[:7]}", "\n".join(lines) + "\n",
                 {"against": commit, "threads": a.threads, "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
