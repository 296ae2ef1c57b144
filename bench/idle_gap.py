"""Does a stage compute slower after it has idled? One stage core holding every layer, one decode step per call,
in blocks of 8 steps: back to back, or each step after a sleep of `--gap-ms` (the other stage's turn in a pipeline
whose stages take turns). The blocks alternate within the process, so the host's drift falls on both.

    .venv/bin/python bench/idle_gap.py [--threads 1,2] [--gap-ms 15] [--blocks 30] [--out bench/results]

Why: in `bench/stage_boundary.py` most of the boundary is the pp=2 stages' own compute running slower than pp=1's
(docs/performance.md), with one torch thread a process as with two, so not the OpenMP threads of one stage spinning on
the other's cores. A pp=2 stage idles through the other's half of every step; pp=1 computes back to back within a
call. This measures what an idle gap alone costs the step after it, with nothing else running. Reported: the median
compute per step (`stats.compute_s`) in each mode and their ratio, per thread count (one fresh process each).
Writes bench/results/<host>-<date>-idle-gap.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import child_json, machine, save_results  # noqa: E402  (ROOT is on the path now)
from bench.stage_boundary import PROMPT, STEPS, past_the_model, topology  # noqa: E402

MODES = ("back to back", "after a gap")


def cycles(blocks: int) -> int:
    """In `stage_boundary`'s terms (`context`: room for (cycles + 1) calls of STEPS after the prompt), what
    `blocks` pairs of blocks of STEPS steps fill."""
    return 2 * blocks - 1


def measure(a: argparse.Namespace, threads: int) -> dict[str, list[float]]:
    """In this process: `a.blocks` pairs of blocks, the order of the two modes swapped from pair to pair."""
    import structlog
    import torch
    import torch.distributed as dist

    from shardmesh.core.step import SamplingParams, StepEntry
    from shardworker.runtime import StageWorkerCore

    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    core = StageWorkerCore("w0", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()), 120.0)
    core.apply(topology(Path(a.model_dir), a.dtype, 1, store.port, 1, 1, cycles(a.blocks)))
    greedy = SamplingParams()
    token = core.step(1, [StepEntry("r0", 0, 0, len(PROMPT), PROMPT, greedy)]).sampled[0].token_id
    pos, out = len(PROMPT), {m: [] for m in MODES}
    for b in range(a.blocks):
        for mode in MODES if b % 2 == 0 else MODES[::-1]:
            for _ in range(STEPS):
                if mode == "after a gap":
                    time.sleep(a.gap_ms / 1e3)
                c0 = core.stats.compute_s
                token = core.step(1, [StepEntry("r0", 0, pos, 1, (token,), greedy)]).sampled[0].token_id
                out[mode].append((core.stats.compute_s - c0) * 1e3)
                pos += 1
    core.close()
    return out


def markdown(info: dict, a: argparse.Namespace, found: dict[int, dict[str, list[float]]]) -> str:
    lines = [
        f"# A step after an idle gap against one back to back ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}, load average "
        f"{info.get('load_avg_1m')} at the start. Model `{a.model}` in {a.dtype}, one sequence, one stage core with "
        f"every layer, one decode step per call; {a.blocks} pairs of blocks of {STEPS} steps, back to back or each "
        f"after a sleep of {a.gap_ms:g} ms, alternated. Medians of the compute per step (`stats.compute_s`).",
        "",
        "| torch threads | back to back ms | after a gap ms | after ÷ back to back |",
        "|---:|---:|---:|---:|",
    ]
    for threads, got in found.items():
        tight, idle = statistics.median(got[MODES[0]]), statistics.median(got[MODES[1]])
        lines.append(f"| {threads} | {tight:.2f} | {idle:.2f} | **{idle / tight:.3f}×** ({idle - tight:+.2f} ms) |")
    return "\n".join([*lines, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--gap-ms", type=float, default=15.0)
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # in a child: measure at this many threads
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a, a.one)))
        return
    if a.blocks < 1 or a.gap_ms < 0 or min(a.threads) < 1:
        ap.error(f"--blocks and --threads must be positive, --gap-ms not negative (got {a.blocks}, {a.threads}, "
                 f"{a.gap_ms})")  # fmt: skip
    from shardmesh.models.registry import resolve

    model_dir = resolve(a.model)
    if why := past_the_model(model_dir, cycles(a.blocks)):
        ap.error(f"--blocks {a.blocks}: {why}")
    info, found = machine(), {}
    for threads in a.threads:  # a fresh process each: one OpenMP team size per process
        args = [sys.executable, __file__, *sys.argv[1:], "--one", str(threads), "--model-dir", str(model_dir)]
        env = {"OMP_NUM_THREADS": str(threads), "SHARDMESH_LOG_LEVEL": "warning"}
        found[threads] = child_json(args, env, f"the child of {threads} thread(s)")
    save_results(Path(a.out), info, "-idle-gap", markdown(info, a, found),
                 {"args": {k: str(v) for k, v in vars(a).items()}, "compute_ms": found})  # fmt: skip


if __name__ == "__main__":
    main()
