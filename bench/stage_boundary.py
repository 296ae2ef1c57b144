"""What a pipeline stage boundary costs per decode step, measured in stage cores without the gateway, with pp=1 and
pp=2 alternated call by call so that this host's drift cancels.

    .venv/bin/python bench/stage_boundary.py [--model smollm2-135m-instruct] [--dtype float32] [--rows 1,16]
                                             [--cycles 40] [--spin-variants N,...] [--tp N] [--against REV]
                                             [--compute-priority auto] [--out bench/results]

Why: through the mesh (bench/run.py, bench/pipeline_seams.py) pp=2 minus pp=1 moved by ±5 ms from one round to the
next on the 2-vCPU machines here, where the target is 0.5 ms: a request takes seconds, and this host's memory speed
changes within seconds. Here five processes stay up, each a `StageWorkerCore` holding its shard as a worker does:
one with all the layers (pp=1), two stages of a pipeline whose links are shared-memory rings (`shm_link`, the default
on one host), and two whose links are Gloo (SHARDMESH_LINK_TRANSPORT=gloo). Every process has `--threads` torch
threads (2), GOMP_SPINCOUNT as `up` sets it for stages taking turns on shared cores, and its compute thread at the
priority `up --compute-priority auto` gives pp=2 on this host's cores (real-time where the OS allows it; until
2026-11-29 this bench ran every stage core at normal priority, unlike the meshes). A cycle runs one call of 8
decode steps on each layout in turn (the order rotates from cycle to cycle), the others idle meanwhile, as in
`up --pipeline turns`; the last stage sends each drawn token back to the first over the loop link. A number is one
call's ms per token;
each derived number is taken within a cycle and reported as the median over cycles with its quartiles:
- stage boundary: pp=2's ms/token minus pp=1's (target <= 0.5 ms), at each of `--rows` sequences per step, with a
  95% interval of its median over cycles that assumes nothing of their distribution (`conditions.median_interval`):
  whether the run tells the boundary from the target at all;
- pp=2 ÷ pp=1 tokens per second at the largest `--rows` (target >= 0.9x at 16);
- the boundary split in two: the pp=2 stages' compute per token (each stage's `stats.compute_s`, its steps less its
  waits for input) minus pp=1's, and the rest (the links, each step's Python, the stages' handing over);
- the seam on the critical path, timestamped: every forward of the CPU decode path (`CpuDecode.run`; a stage that
  receives its input inside the call, `CpuDecode.run_received`, from when that input was there; pp=1's later steps
  drawn greedily in one call, `run_drawn_steps`, and a pipeline's last stage's, `run_drawn_steps_received`, as
  those calls stamp them, the draw inside) is stamped on
  `time.perf_counter` (one clock for all the processes), and a token's time between forwards (pp=1: from one
  forward's end to the next's start; pp=2: around the loop and the activations' hop) is taken less pp=1's within
  each cycle. What the boundary itself adds to a token, in tenths of a millisecond, where the wall time moves by
  milliseconds; beside it, how much longer the stages' forwards took than pp=1's.
`--spin-variants 3000,1000` adds shm pipelines whose processes get that GOMP_SPINCOUNT instead (one more layout each).
`--tp 3` adds one stage split over 3 tensor-parallel ranks (processes of `--tp-threads` threads each, as `up` gives
them: the cores split among the ranks), and a table of its time per token over pp=1's in each cycle (target <= 1.5x
on this 2-core host).
`--against REV` adds pp=1 and a pp=2 on rings of commit REV, and its tp layout with `--tp` (checked out into a
temporary git worktree, its stage processes importing the project from there), alternated with this checkout's in the
same cycles, and a table of each layout's ms per token and its work around the forward, this checkout against REV.
The work around the forward is each stage's thread CPU in a decode call (`StageWorkerCore._decode_steps`) less its
forward's (`CpuDecode.run`, the CPU decode path's), per token and summed over the stages: what a step does besides
its layers and head, which the drift of this host's memory speed moves far less than the wall time. Two trees running
the same code read up to ~3% apart in one run (an A/A run, docs/performance.md), so a ratio within that is noise.
What it leaves out: the gateway's round trip, paid once per call of 8 steps by both layouts (twice as many Step
RPCs for pp=2, one per stage, sent at once). Writes bench/results/<host>-<date>-stage-boundary.{md,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.conditions import BOUNDARY_GOAL_MS, interval_side, machine, median_interval, save_results  # noqa: E402

# A stage process of `--against REV`'s layouts imports the project from REV's worktree, ahead of this checkout on the
# path; this script and its helpers (bench/conditions.py, imported above) come from here.
TREE = os.environ.get("SHARDMESH_BENCH_TREE") or str(ROOT)
sys.path.insert(0, TREE)

STEPS = 8  # decode steps per call, as the gateway's default --decode-steps
# name: (stages, SHARDMESH_LINK_TRANSPORT): "shm" fails loudly where the ring cannot be had, so the row is what it says
LAYOUTS = {"pp=1": (1, "auto"), "pp=2 shm": (2, "shm"), "pp=2 gloo": (2, "gloo")}


class Layout(NamedTuple):
    stages: int
    transport: str  # SHARDMESH_LINK_TRANSPORT
    spin: str  # GOMP_SPINCOUNT
    rev: str = ""  # the commit whose code the stages run (`--against`); "": this checkout
    tp: int = 1  # tensor-parallel ranks per stage
    threads: int = 0  # torch threads per process; 0: `--threads`

    @property
    def processes(self) -> int:
        return self.stages * self.tp


def layouts_of(a: argparse.Namespace) -> dict[str, Layout]:
    """Every layout by name; `--spin-variants` adds shm pipelines whose stages spin that long before sleeping (what an
    idle stage's OpenMP threads take from the stage computing), `--tp N` one stage over N ranks, `--against REV`
    pp=1 and pp=2 on rings (and the tp layout) of REV."""
    tp = a.tp
    ranks = Layout(1, "auto", a.spincount, "", tp, a.tp_threads) if tp > 1 else None
    out = {name: Layout(stages, transport, a.spincount) for name, (stages, transport) in LAYOUTS.items()}
    for spin in a.spin_variants:
        out[f"pp=2 shm spin={spin}"] = Layout(2, "shm", spin)
    if ranks:
        out[f"tp={tp}"] = ranks
    if a.against:
        out[f"pp=1 @{a.against}"] = Layout(1, "auto", a.spincount, a.against)
        out[f"pp=2 shm @{a.against}"] = Layout(2, "shm", a.spincount, a.against)
        if ranks:
            out[f"tp={tp} @{a.against}"] = ranks._replace(rev=a.against)
    return out


PROMPT = (1, 17, 5, 42, 9, 3, 8, 100)
TIMEOUT = timedelta(seconds=600)


def context(cycles: int) -> int:
    """The positions one sequence fills: the prompt, then a call of `STEPS` per cycle and the warm-up's."""
    return len(PROMPT) + (cycles + 1) * STEPS


def past_the_model(model_dir: Path, cycles: int) -> str:
    """Why `cycles` do not fit the model's positions (`context`), or ""."""
    from shardmesh.core.config import ModelConfig

    longest = ModelConfig.from_dir(model_dir).max_position_embeddings
    if context(cycles) <= longest:
        return ""
    return f"a sequence would reach position {context(cycles)}, past the model's max_position_embeddings={longest}"


def topology(model_dir: Path, dtype: str, stages: int, port: int, epoch: int, rows: int, cycles: int,
             tp: int = 1) -> Any:  # fmt: skip
    """pp = `stages`, tp = `tp`, tensor-parallel rank t of stage i held by worker "w{i * tp + t}", the layers split
    evenly, a rendezvous of `epoch`, room for every cycle's tokens."""
    from shardmesh.core import topology as t
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.layout import split_layers

    cfg = ModelConfig.from_dir(model_dir)
    spans = split_layers(cfg.num_layers, stages)
    placed = tuple(t.Stage(i, a, b, tuple(t.ShardAssignment(r, i * tp + r, f"w{i * tp + r}", "", t.ShardState.READY)
                                          for r in range(tp)))
                   for i, (a, b) in enumerate(spans))  # fmt: skip
    spec = t.ModelSpec(str(model_dir), dtype, "LlamaForCausalLM", cfg.num_layers, cfg.hidden_size, cfg.vocab_size,
                       context(cycles))  # fmt: skip
    limits = t.ServingLimits(rows, context(cycles), max(rows * len(PROMPT), 64))
    return t.Topology(epoch, spec, stages, tp, placed, t.Rendezvous.for_epoch("127.0.0.1", port, epoch, stages * tp),
                      True, limits)  # fmt: skip


def around_the_forward() -> tuple[list[float], list[tuple[float, float]]]:
    """[thread CPU seconds in decode calls, of which in their forwards], kept up to date by wrapping
    `StageWorkerCore._decode_steps` and `CpuDecode.run` (both run on the core's compute thread), so that a cycle's
    work around the forward is the first's growth less the second's; and every forward of the CPU decode path as
    (start, end) on `time.perf_counter`. On Linux that clock is CLOCK_MONOTONIC, one clock for every process on the
    host, so the forwards of two stages' processes can be laid end to end (`seams`)."""
    from shardmesh.engine.cpu_decode import CpuDecode
    from shardworker.runtime import StageWorkerCore

    spent = [0.0, 0.0]
    spans: list[tuple[float, float]] = []

    def timed(f: Any, i: int, stamped: list[tuple[float, float]] | None = None) -> Any:
        def run(*args: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return f(*args)
            finally:
                spent[i] += time.thread_time() - c0
                if stamped is not None:
                    stamped.append((t0, time.perf_counter()))

        return run

    StageWorkerCore._decode_steps = timed(StageWorkerCore._decode_steps, 0)  # type: ignore[method-assign]
    CpuDecode.run = timed(CpuDecode.run, 1, spans)  # type: ignore[method-assign]

    def stamped(f: Any, forwards: Any) -> Any:
        # A call that runs its forwards itself, each from when its input was there: its thread CPU goes to the
        # forwards, and `forwards(self)` gives their spans once it has returned something (None: it ran nothing).
        def run(self: Any, *args: Any) -> Any:
            c0 = time.thread_time()
            try:
                out = f(self, *args)
            finally:
                spent[1] += time.thread_time() - c0
            if out is not None:
                spans.extend(forwards(self))
            return out

        return run

    ways = {  # a commit from before a way (`--against`) has no such method
        # Waits for its input, computes, and may send its output on: its forward runs from when the input was there
        # to the send.
        "run_received": lambda self: [(self.arrived, time.perf_counter() - self.sending)],
        # Draws its steps itself (pp=1's, a pipeline's last stage's): each step as the call stamped it. Commits from
        # before sampled rows drew there too (a407c11) named them for greedy steps.
        "run_drawn_steps": lambda self: self.stamps,
        "run_drawn_steps_received": lambda self: self.stamps,
        "run_greedy_steps": lambda self: self.stamps,
        "run_greedy_steps_received": lambda self: self.stamps,
    }
    for name, forwards in ways.items():
        if (f := getattr(CpuDecode, name, None)) is not None:
            setattr(CpuDecode, name, stamped(f, forwards))
    return spent, spans


def stage_main(layout: str, rank: int, port: int, a: argparse.Namespace) -> None:
    """One stage core (rank `rank` of its layout): join its layout's groups, then for every cycle wait for its turn,
    run one call, signal. The last stage's tensor-parallel rank 0 reports the call and hands its tokens on."""
    import structlog
    import torch
    import torch.distributed as dist

    from shardmesh.core.step import SamplingParams, StepEntry
    from shardworker.runtime import StageWorkerCore

    clock, spans = around_the_forward()
    layouts = layouts_of(a)
    spec = layouts[layout]
    torch.set_num_threads(spec.threads or a.threads)
    stages, stage = spec.stages, rank // spec.tp
    names = list(layouts)
    epoch = names.index(layout) + 1  # each layout's groups under a prefix of their own
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    # A commit from before compute priorities (`--against`) takes no `priority`: its stage cores run at normal priority.
    takes = "priority" in inspect.signature(StageWorkerCore).parameters
    asked = {"priority": a.compute_priority} if takes else {}
    core = StageWorkerCore(f"w{rank}", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()), 120.0,
                           **asked)  # fmt: skip
    last = stage == stages - 1 and rank % spec.tp == 0
    results: dict[int, list[float]] = {}
    computed: dict[int, list[float]] = {}  # this stage's compute per token (`stats.compute_s`: its steps less waits)
    around: dict[int, list[float]] = {}  # its thread CPU per token in decode calls, less their forwards'
    spanned: dict[int, list[list[tuple[float, float]]]] = {}  # each call's forwards (CPU decode path), as (start, end)
    for rows in a.rows:
        core.apply(topology(Path(a.model_dir), a.dtype, stages, port, epoch + 10 * rows, rows, a.cycles, spec.tp))
        greedy = SamplingParams()
        first = core.step(epoch + 10 * rows, [StepEntry(f"r{i}", i, 0, len(PROMPT), PROMPT, greedy)
                                              for i in range(rows)])  # fmt: skip
        key = f"{layout}/{rows}/tokens"
        if last:
            store.set(key, json.dumps([s.token_id for s in first.sampled]))
        tokens, pos, times, compute, besides, calls = json.loads(store.get(key)), len(PROMPT), [], [], [], []
        for c in range(a.cycles + 1):  # cycle 0 warms up
            order = names[c % len(names) :] + names[: c % len(names)]
            before = order[: order.index(layout)]
            if before:
                store.wait([f"{rows}/{c}/{before[-1]}"])
            entries = [StepEntry(f"r{i}", i, pos, 1, (tokens[i],), greedy) for i in range(rows)]
            t0, c0, (call0, forward0), n0 = time.perf_counter(), core.stats.compute_s, clock, len(spans)
            result = core.step(epoch + 10 * rows, entries, STEPS)
            calls.append(spans[n0:])
            times.append((time.perf_counter() - t0) * 1e3 / STEPS)
            compute.append((core.stats.compute_s - c0) * 1e3 / STEPS)
            besides.append(((clock[0] - call0) - (clock[1] - forward0)) * 1e3 / STEPS)
            pos += STEPS
            key = f"{layout}/{rows}/{c}/tokens"
            if last:
                store.set(key, json.dumps([s.token_id for s in result.sampled[-rows:]]))
                store.set(f"{rows}/{c}/{layout}", "done")  # the last stage ends the call
            tokens = json.loads(store.get(key))
            store.wait([f"{rows}/{c}/{order[-1]}"])  # the cycle is over for everyone
        results[rows], computed[rows], around[rows], spanned[rows] = times[1:], compute[1:], besides[1:], calls[1:]
        core.release([(f"r{i}", i) for i in range(rows)])
    store.set(f"compute/{layout}/{rank}", json.dumps(computed))
    store.set(f"around/{layout}/{rank}", json.dumps(around))
    store.set(f"spans/{layout}/{rank}", json.dumps(spanned))
    if last:
        store.set(f"result/{layout}", json.dumps({"ms": results}))
    core.close()


def run(a: argparse.Namespace, trees: dict[str, str]) -> dict[str, Any]:
    """Every layout's per-cycle numbers; `trees`: the worktree of each commit a layout runs (`Layout.rev`)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)
    procs = []
    layouts = layouts_of(a)
    for layout, spec in layouts.items():
        tree = trees[spec.rev] if spec.rev else str(ROOT)
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads or a.threads), "SHARDMESH_LOG_LEVEL": "warning",
               "SHARDMESH_LINK_TRANSPORT": spec.transport, "PYTHONPATH": tree, "SHARDMESH_BENCH_TREE": tree,
               "GOMP_SPINCOUNT": spec.spin}  # fmt: skip
        for rank in range(spec.processes):
            args = [sys.executable, __file__, "--stage-of", layout, str(rank), str(store.port), *sys.argv[1:],
                    "--compute-priority", a.compute_priority]  # fmt: skip
            procs.append(subprocess.Popen(args, env=env, cwd=ROOT))
    try:
        for p in procs:
            if p.wait(timeout=3600) != 0:
                raise RuntimeError(f"a stage process failed: {p.args}")
        got = {layout: json.loads(store.get(f"result/{layout}")) for layout in layouts}
        for layout, spec in layouts.items():
            for key in ("compute", "around"):  # per cycle, summed over the processes
                each = [json.loads(store.get(f"{key}/{layout}/{i}")) for i in range(spec.processes)]
                got[layout][f"{key}_ms"] = {r: [sum(c) for c in zip(*(e[r] for e in each), strict=True)]
                                            for r in each[0]}  # fmt: skip
            if spec.tp == 1:  # each stage's forwards, in stage order
                got[layout]["spans"] = [json.loads(store.get(f"spans/{layout}/{i}")) for i in range(spec.processes)]
        return got
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def pp1_of(layout: str) -> str:
    """The pp=1 layout a pipeline's boundary is taken against: its commit's (`--against`), else this checkout's."""
    return f"pp=1 @{layout.rsplit(' @', 1)[1]}" if " @" in layout else "pp=1"


def derived(got: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in rows:
        for layout in (name for name in got if name.startswith("pp=2")):
            pp1 = got[pp1_of(layout)]
            base, mine = pp1["ms"][str(r)], got[layout]["ms"][str(r)]
            diff = [b - a for a, b in zip(base, mine, strict=True)]
            ratio = [a / b for a, b in zip(base, mine, strict=True)]  # tokens/s of pp=2 over pp=1
            # the boundary split: the stages' compute beside pp=1's, and the rest (links, waits, per-step Python)
            more = [b - a for a, b in zip(pp1["compute_ms"][str(r)], got[layout]["compute_ms"][str(r)],
                                          strict=True)]  # fmt: skip
            rest = [d - m for d, m in zip(diff, more, strict=True)]
            q = statistics.quantiles(diff, n=4)
            out[f"{layout} rows={r}"] = {
                "pp1_ms": statistics.median(base), "pp2_ms": statistics.median(mine),
                "boundary_ms": statistics.median(diff), "boundary_quartiles": [q[0], q[2]],
                "boundary_interval": median_interval(diff),
                "compute_more_ms": statistics.median(more), "rest_ms": statistics.median(rest),
                "ratio": statistics.median(ratio),
            }  # fmt: skip
    return out


# The gaps before forwards 2 .. STEPS - 1 of a call lie inside `_later_steps` in every layout. Before forward 1, pp=1
# builds the call's later layouts on its critical path, a pipeline's first stage beside the other stage's forward.
FIRST_GAP = 2


def serial_path(stages: list[list[list[float]]]) -> tuple[float, float] | None:
    """One call's ms per token on its critical path outside the forwards, and in them, from each stage's forwards
    ((start, end) each, `around_the_forward`; stage order): per step k, from the last stage's forward k - 1 to the first
    stage's forward k (sampling, the loop hop, the steps' Python), then from each stage's forward k to the next
    stage's (the activations' hops), over steps FIRST_GAP .. STEPS - 1. None if a stage ran other forwards (a call
    off the CPU decode path)."""
    if any(len(spans) != STEPS for spans in stages):
        return None
    gaps, forwards = [], []
    for k in range(FIRST_GAP, STEPS):
        gap = stages[0][k][0] - stages[-1][k - 1][1]
        gaps.append(gap + sum(b[k][0] - a[k][1] for a, b in itertools.pairwise(stages)))
        forwards.append(sum(spans[k][1] - spans[k][0] for spans in stages))
    return statistics.mean(gaps) * 1e3, statistics.mean(forwards) * 1e3


def seams(got: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """What each pipeline's seams add to a token's critical path, from the forwards' timestamps: per cycle, pp=2's
    time between forwards less its commit's pp=1's (the seam), and its stages' forwards less pp=1's; medians over
    cycles. Empty where the forwards did not all run the CPU decode path."""
    out: dict[str, Any] = {}
    for r in rows:
        for layout in (name for name in got if name.startswith("pp=2") and "spans" in got[name]):
            base, mine = got[pp1_of(layout)]["spans"], got[layout]["spans"]
            per_cycle = [(serial_path([base[0][str(r)][c]]), serial_path([s[str(r)][c] for s in mine]))
                         for c in range(len(base[0][str(r)]))]  # fmt: skip
            both = [(a, b) for a, b in per_cycle if a is not None and b is not None]
            if not both:
                continue
            seam = [b[0] - a[0] for a, b in both]
            q = statistics.quantiles(seam, n=4) if len(seam) > 1 else [seam[0]] * 3
            out[f"{layout} rows={r}"] = {
                "pp1_between_ms": statistics.median(a[0] for a, _ in both),
                "pp2_between_ms": statistics.median(b[0] for _, b in both),
                "seam_ms": statistics.median(seam), "seam_quartiles": [q[0], q[2]],
                "forwards_more_ms": statistics.median(b[1] - a[1] for a, b in both),
                # per cycle: pp=1's ms per token between forwards and in them, then pp=2's
                "per_cycle_ms": [[round(x, 4) for x in (*a, *b)] for a, b in both],
            }  # fmt: skip
    return out


def without_spans(got: dict[str, Any]) -> dict[str, Any]:
    """`got` less the forwards' timestamps (`seams` keeps what they give per cycle), as the results file holds it."""
    return {layout: {k: v for k, v in d.items() if k != "spans"} for layout, d in got.items()}


def over_pp1(got: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """Each tensor-parallel layout's ms per token over its commit's pp=1's, within each cycle: median and quartiles."""
    out: dict[str, Any] = {}
    for r in rows:
        for layout in (name for name in got if name.startswith("tp=")):
            base, mine = got[pp1_of(layout)]["ms"][str(r)], got[layout]["ms"][str(r)]
            ratio = [b / a for a, b in zip(base, mine, strict=True)]
            out[f"{layout} rows={r}"] = {
                "pp1_ms": statistics.median(base), "ms": statistics.median(mine),
                "over_pp1": statistics.median(ratio), "over_pp1_quartiles": statistics.quantiles(ratio, n=4)[::2],
            }  # fmt: skip
    return out


def against(got: dict[str, Any], rows: list[int], rev: str) -> dict[str, Any]:
    """This checkout's layouts against REV's, within each cycle: ms per token (ratio, this ÷ REV) and the work around
    the forward (thread CPU per token, all stages; difference), medians over cycles."""
    out: dict[str, Any] = {}
    for r in rows:
        for layout in (name for name in got if f"{name} @{rev}" in got):
            mine, theirs = got[layout], got[f"{layout} @{rev}"]
            ratio = [a / b for a, b in zip(mine["ms"][str(r)], theirs["ms"][str(r)], strict=True)]
            around = [a - b for a, b in zip(mine["around_ms"][str(r)], theirs["around_ms"][str(r)], strict=True)]
            out[f"{layout} rows={r}"] = {
                "ms": statistics.median(mine["ms"][str(r)]), "rev_ms": statistics.median(theirs["ms"][str(r)]),
                "ms_ratio": statistics.median(ratio), "ms_ratio_quartiles": statistics.quantiles(ratio, n=4)[::2],
                "around_ms": statistics.median(mine["around_ms"][str(r)]),
                "rev_around_ms": statistics.median(theirs["around_ms"][str(r)]),
                "around_diff_ms": statistics.median(around),
            }  # fmt: skip
    return out


def _table(head: list[str], found: dict[str, Any], cells: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """A markdown table of `found` ("<layout> rows=<n>": numbers), a row each: the layout, n, then `cells`."""
    lines = ["| layout | sequences per step | " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(head)]
    for name, d in found.items():
        layout, rows = name.rsplit(" rows=", 1)
        lines.append(f"| {layout} | {rows} | " + " | ".join(cells(d)) + " |")
    return lines


def _interval(bounds: tuple[float, float] | None) -> str:
    """A boundary's `median_interval` as the table shows it: against the target, where the run can tell."""
    if bounds is None:
        return "too few cycles"
    low, high = bounds
    return f"{low:+.2f} to {high:+.2f} ({interval_side(bounds)} {BOUNDARY_GOAL_MS})"


def markdown(info: dict, a: argparse.Namespace, found: dict[str, Any], compared: dict[str, Any] | None = None,
             ranks: dict[str, Any] | None = None, seamed: dict[str, Any] | None = None) -> str:  # fmt: skip
    lines = [
        f"# A stage boundary per decode step, pp=1 and pp=2 (and tp) alternated call by call ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}, load average "
        f"{info.get('load_avg_1m')} at the start. Model `{a.model}` in {a.dtype}, greedy; stage cores in "
        f"{sum(v.processes for v in layouts_of(a).values())} processes (no gateway), {a.threads} torch threads each"
        f"{tp_threads(a)}, "
        f"GOMP_SPINCOUNT={a.spincount} unless the layout names another, compute threads at {a.compute_priority} "
        f"priority; {a.cycles} cycles, each one "
        f"call of {STEPS} decode steps on every layout in a rotating order. Medians over cycles of the per-cycle "
        f"values (quartiles of the boundary in brackets).",
        "",
        *_table(["pp=1 ms/token", "pp=2 ms/token", "stage boundary ms", "95% interval of its median",
                 "of which compute", "of which the rest", "pp=2 ÷ pp=1 tok/s"], found,
                lambda d: [f"{d['pp1_ms']:.2f}", f"{d['pp2_ms']:.2f}", f"**{d['boundary_ms']:+.2f}** "
                           f"({d['boundary_quartiles'][0]:+.2f} to {d['boundary_quartiles'][1]:+.2f})",
                           _interval(d.get("boundary_interval")),
                           f"{d['compute_more_ms']:+.2f}", f"{d['rest_ms']:+.2f}", f"{d['ratio']:.3f}×"]),
    ]  # fmt: skip
    lines += ["", "Targets: stage boundary <= 0.5 ms per step (one sequence); pp=2 >= 0.9× pp=1's tokens at 16 "
              "sequences. Not included: the gateway's round trip, once per call of 8 steps. Of the boundary, "
              "`compute` is the pp=2 stages' compute per token (each stage's steps less their waits for input) "
              "minus pp=1's, and `the rest` what is left: the links, the stages' waits, each step's Python. A layout "
              "of another commit (`@REV`) is taken against that commit's pp=1.",
              ""]  # fmt: skip
    if seamed:
        lines += ["## The seam on the critical path, timestamped", "",
                  *_table(["pp=1 between forwards, ms/token", "pp=2 between forwards", "seam (quartiles)",
                           "forwards, pp=2 - pp=1"], seamed,
                          lambda d: [f"{d['pp1_between_ms']:.3f}", f"{d['pp2_between_ms']:.3f}",
                                     f"**{d['seam_ms']:+.3f}** ({d['seam_quartiles'][0]:+.3f} to "
                                     f"{d['seam_quartiles'][1]:+.3f})", f"{d['forwards_more_ms']:+.3f}"]),
                  "", "Between forwards: a token's time on the critical path outside the forwards of the CPU decode "
                  "path (`CpuDecode.run`). In pp=1 from one forward's end to the next's start (sampling, the step's "
                  "Python); in pp=2 from the last stage's forward end to the first stage's next forward start "
                  "(sampling, the loop hop, both stages' Python), plus from the first stage's forward end to the "
                  "last stage's start (the activations' hop). The seam is pp=2's less pp=1's within each cycle: "
                  "what the stage boundary itself adds to a token, which this host's drift in memory speed does not "
                  "enter; `forwards` is the stages' layers and head taking longer than the whole's. Timestamps on "
                  f"`time.perf_counter` (CLOCK_MONOTONIC, one clock for all the processes), steps {FIRST_GAP + 1} "
                  f"to {STEPS} of each call.", ""]  # fmt: skip
    if ranks:
        lines += ["## Tensor parallelism against pp=1, in the same cycles", "",
                  *_table(["pp=1 ms/token", "tp ms/token", "tp ÷ pp=1 (quartiles)"], ranks,
                          lambda d: [f"{d['pp1_ms']:.2f}", f"{d['ms']:.2f}", f"**{d['over_pp1']:.3f}×** "
                                     f"({d['over_pp1_quartiles'][0]:.3f} to {d['over_pp1_quartiles'][1]:.3f})"]),
                  "", "Target: tp=3 within 1.5× of pp=1's time per token on this 2-core host (within 1.1× with a core "
                  "per rank). Each ratio is taken within a cycle; a layout of another commit against that commit's "
                  "pp=1.", ""]  # fmt: skip
    if compared:
        lines += [f"## This checkout against {a.against} ({a.against_commit[:12]}), alternated in the same cycles", "",
                  *_table(["ms/token", "ms/token at REV", "this ÷ REV (quartiles)",
                           "work around the forward, ms/token", "at REV", "difference"], compared,
                          lambda d: [f"{d['ms']:.2f}", f"{d['rev_ms']:.2f}", f"**{d['ms_ratio']:.3f}×** "
                                     f"({d['ms_ratio_quartiles'][0]:.3f} to {d['ms_ratio_quartiles'][1]:.3f})",
                                     f"{d['around_ms']:.3f}", f"{d['rev_around_ms']:.3f}",
                                     f"**{d['around_diff_ms']:+.3f}**"])]  # fmt: skip
        lines += ["", "The work around the forward: each stage's thread CPU in its decode calls less their forwards' "
                  "(`CpuDecode.run`), per token, summed over the layout's stages; medians over cycles, and of the "
                  "per-cycle differences.", ""]  # fmt: skip
    return "\n".join(lines)


def tp_threads(a: argparse.Namespace) -> str:
    """What the markdown says of the tensor-parallel ranks' threads, if there are any."""
    spec = next((v for v in layouts_of(a).values() if v.tp > 1), None)
    return f" ({spec.tp} tensor-parallel ranks: {spec.threads} each)" if spec else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument(
        "--spincount",
        default=os.environ.get("GOMP_SPINCOUNT", "10000"),
        help="GOMP_SPINCOUNT of every layout (what `up` sets for turns)",
    )
    ap.add_argument(
        "--spin-variants",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="more shm pipelines, each with this GOMP_SPINCOUNT (comma-separated)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads per process (2: what `up` gives stages taking turns on 2 cores)",
    )
    ap.add_argument("--tp", type=int, default=0, help="add one stage over this many tensor-parallel ranks (0: none)")
    ap.add_argument("--tp-threads", type=int, default=0, help="torch threads per tp rank (0: the cores split by rank)")
    ap.add_argument("--against", default="", help="a commit whose pp=1 and pp=2 run beside this checkout's")
    ap.add_argument(
        "--compute-priority",
        default="auto",
        choices=("auto", "normal", "realtime"),
        help="the stage cores' compute threads' priority (auto: what `up --compute-priority auto` gives pp=2 here)",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stage-of", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tp and not a.tp_threads:
        from shardmesh.rpc.procs import cores
        from shardmesh_cli.up import share_cores

        a.tp_threads = share_cores(1, a.tp, "cpu", "auto", None, cores()).worker_threads  # as `up` gives the ranks
    if a.stage_of:
        layout, rank, port = a.stage_of
        stage_main(layout, int(rank), int(port), a)
        return
    if a.compute_priority == "auto":  # resolved here once; the stage cores are told the answer
        from shardmesh.rpc.procs import cores
        from shardmesh_cli.up import share_cores

        a.compute_priority = share_cores(2, 1, "cpu", "auto", a.threads, cores(), priority="auto").compute_priority
    if a.cycles < 4 or min(a.rows) < 1 or a.threads < 1 or a.tp == 1 or a.tp < 0:
        ap.error(
            f"--cycles must be at least 4, --rows and --threads positive, --tp 0 or above 1 (got {a.cycles}, "
            f"{a.rows}, {a.threads}, {a.tp})"
        )
    from shardmesh.models.registry import resolve

    model_dir = resolve(a.model)
    if why := past_the_model(model_dir, a.cycles):
        ap.error(f"--cycles {a.cycles}: {why}")
    sys.argv += ["--model-dir", str(model_dir)]
    info = machine()
    from bench.against import checked_out

    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "against"
        with checked_out(a.against, tree) if a.against else contextlib.nullcontext("") as a.against_commit:
            got = run(a, {a.against: str(tree)} if a.against else {})
    found, ranks, seamed = derived(got, a.rows), over_pp1(got, a.rows), seams(got, a.rows)
    compared = against(got, a.rows, a.against) if a.against else None
    save_results(Path(a.out), info, "-stage-boundary", markdown(info, a, found, compared, ranks, seamed),
                 {"args": {k: str(v) for k, v in vars(a).items()}, "per_cycle_ms": without_spans(got), "derived": found,
                  "against": compared, "tp_over_pp1": ranks, "seams": seamed})  # fmt: skip


if __name__ == "__main__":
    main()
