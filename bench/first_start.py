"""A fresh machine's first start: `shardmesh up` with no kernel built yet, this checkout against an earlier commit.

    .venv/bin/python bench/first_start.py REV [--pp 2] [--rounds 2] [--out bench/results]

The first `make run` on a machine (or after torch or the virtual environment changed) compiles the C++ kernels the
workers use before the mesh serves (`engine/native.py`). Each side here starts `shardmesh up --model
smollm2-135m-instruct --pp P --demo` with an empty $TORCH_EXTENSIONS_DIR of its own, so every kernel is compiled, and
reads the time to ready that `up` prints ("ready in S s": from the start to the gateway serving), and each worker's
`kernel_built` log lines. REV is checked out into a temporary git worktree (removed afterwards), its processes
importing the project from there; the two sides alternate round by round, so the host's drift falls on both.
Writes bench/results/<host>-<date>-first-start.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.against import checked_out  # noqa: E402  (the repository root is on the path now)
from bench.conditions import alternated, machine, pythonpath, save_results  # noqa: E402

READY = re.compile(r"\(ready in ([0-9.]+) s; logs in ([^)]+)\)")
START_TIMEOUT_S = 900  # every kernel compiled on 2 cores, both workers loading: about two minutes before any change


def kernel_builds(logs: Path) -> dict[str, float]:
    """Seconds each kernel's build took, as the worker that waited longest logged it (`kernel_built`)."""
    built: dict[str, float] = {}
    for log in sorted(logs.glob("worker*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "kernel_built":
                kernel = str(event.get("kernel", "?"))
                built[kernel] = max(built.get(kernel, 0.0), float(event.get("seconds", 0.0)))
    return built


def start(tree: Path, pp: int) -> dict:
    """One first start of the mesh from `tree`: its time to ready and its kernels' builds."""
    with tempfile.TemporaryDirectory(prefix="shardmesh-first-start-") as cache:
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": cache, "PYTHONPATH": pythonpath(tree)}
        done = subprocess.run([sys.executable, "-m", "shardmesh_cli", "up", "--model", "smollm2-135m-instruct",
                               "--pp", str(pp), "--max-new-tokens", "8", "--demo", "Hi"],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)  # fmt: skip
    found = READY.search(done.stderr)
    if done.returncode != 0 or found is None:
        sys.exit(f"shardmesh up from {tree} failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")
    return {"ready_s": float(found.group(1)), "kernels": kernel_builds(Path(found.group(2)))}


def report(info: dict, commit: str, pp: int, runs: dict[str, list[dict]]) -> tuple[str, dict]:
    """The markdown table and the JSON data: each side's median time to ready and the ratio within each round."""
    mine, theirs = (statistics.median(r["ready_s"] for r in runs[s]) for s in ("this", "rev"))
    ratio = statistics.median(a["ready_s"] / b["ready_s"] for a, b in zip(runs["this"], runs["rev"], strict=True))
    lines = [
        f"# First start with every kernel to compile: this checkout against {commit[:10]} ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, torch {info['torch']}; `shardmesh up --pp {pp} "
        f"--demo` from an empty kernel cache, the two sides alternated, {len(runs['this'])} round(s).",
        "",
        "| | ready (s) | each round | kernels built (s, as the slowest worker logged them) |",
        "|---|---:|---|---|",
    ]
    for label, median, rs in (("this", mine, runs["this"]), (commit[:10], theirs, runs["rev"])):
        builds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(rs[0]["kernels"].items()))
        each = " / ".join(f"{r['ready_s']:.1f}" for r in rs)
        lines.append(f"| {label} | {median:.1f} | {each} | {builds} |")
    lines += ["", f"this ÷ {commit[:10]}: **{ratio:.2f}×** (the median of the rounds' ratios)."]
    return "\n".join(lines) + "\n", {"commit": commit, "pp": pp, "runs": runs, "ratio": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rev", help="the commit to compare against, e.g. HEAD~1 or a hash")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args()
    if a.rounds < 1 or a.pp < 1:
        p.error(f"--rounds and --pp must be at least 1, got {a.rounds} and {a.pp}")
    info = machine()
    runs: dict[str, list[dict]] = {"this": [], "rev": []}
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "rev"
        with checked_out(a.rev, other) as commit:
            for r in range(a.rounds):
                for side in alternated(["this", "rev"], r):
                    runs[side].append(start(ROOT if side == "this" else other, a.pp))
                    print(f"round {r + 1} {side}: {runs[side][-1]}", file=sys.stderr)
    md, data = report(info, commit, a.pp, runs)
    save_results(a.out, info, "-first-start", md, data)


if __name__ == "__main__":
    main()
