"""A live pipeline's seams under the kernel's scheduler trace: where each stage's turn goes, thread by thread.

    sudo .venv/bin/python bench/seam_trace.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--new-tokens 64]
                                              [--out bench/results]

`bench/stage_boundary.py` and `bench/pipeline_seams.py` measure what a stage boundary costs; this says where, inside a
running `shardmesh up --pp 2` mesh (stages taking turns on the host's cores), from the scheduler's own record. It
starts the mesh and a pp=1 mesh beside it (whose time per token, just before and just after the trace, is the
baseline; it is idle while the pipeline is traced), serves a warm-up request, then records `sched_switch`,
`sched_waking` and `sched_wakeup` through tracefs (root only; it mounts /sys/kernel/tracing when it is not) over three
one-stream requests, and reads:
- the stages' compute threads: the pair of threads in the two workers that wake each other most (the link's futex
  wake-ups: activations forward, the drawn token back); each stage's partner is its other busiest thread (its
  OpenMP worker);
- a turn: from one compute thread waking the other to the wake-up back, owned by the stage woken;
- per turn, the CPU time of the stage's compute thread and partner, of the other stage, of every other process of
  the mesh (gateway, coordinator, gRPC threads), and the time a vCPU sat idle;
- per hand-over, how long the woken compute thread took to run, and how long after it its partner was running (the
  partner is woken by the stage's first parallel region, after the link's receive and the step's Python).
Medians and quartiles over the turns; a turn at a decode call's boundary (the last stage answers the gateway, the
gateway sends the next call) also holds that round trip, which the means carry and the medians do not.

One quirk of the virtual machines here: switches *from* the idle task are not traced on every vCPU. A task woken
onto an idle vCPU is then taken to run from its `sched_wakeup`, which the idle vCPU emits as it takes the task.
Writes bench/results/<host>-<date>-seam-trace.{md,json}.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import math
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = "sched:sched_switch sched:sched_waking sched:sched_wakeup"
_LINE = re.compile(r"^\s*.+?-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+): (sched_\w+): (.*)$")
_FIELD = re.compile(r"(\w+)=(\S+)")


@dataclass(frozen=True)
class Event:
    ts: float  # seconds
    cpu: int
    current: int  # the thread running on `cpu` as the event fired (for sched_waking: the waker)
    kind: str  # sched_switch, sched_waking, sched_wakeup
    fields: dict[str, str]

    def tid(self, name: str) -> int:
        return int(self.fields[name])


def parse(lines: Iterable[str]) -> list[Event]:
    """The sched events of a tracefs `trace` file (other lines and events skipped)."""
    out = []
    for line in lines:
        m = _LINE.match(line)
        if m:
            current, cpu, ts, kind, rest = m.groups()
            out.append(Event(float(ts), int(cpu), int(current), kind, dict(_FIELD.findall(rest))))
    return out


def running(events: list[Event]) -> list[tuple[float, float, int, int]]:
    """(start, end, cpu, tid) intervals in which `tid` ran on `cpu`; tid 0 is the idle task. Where a vCPU's switch
    from idle is not traced, the task starts at the `sched_wakeup` that the idle vCPU emitted for it, or failing
    that at the first event it emits there."""
    out: list[tuple[float, float, int, int]] = []
    on: dict[int, tuple[int, float]] = {}  # cpu -> (tid, since)
    for e in events:
        now = on.get(e.cpu)
        if now is None:
            on[e.cpu] = now = (e.current, e.ts)
        elif e.current != now[0] and e.current != 0:  # a task we did not see switched in
            out.append((now[1], e.ts, e.cpu, now[0]))
            on[e.cpu] = now = (e.current, e.ts)
        if e.kind == "sched_switch":
            out.append((now[1], e.ts, e.cpu, now[0]))
            on[e.cpu] = (e.tid("next_pid"), e.ts)
        elif e.kind == "sched_wakeup" and now[0] == 0 and e.current == 0 and int(e.fields["target_cpu"]) == e.cpu:
            out.append((now[1], e.ts, e.cpu, 0))
            on[e.cpu] = (e.tid("pid"), e.ts)
    return sorted(out)


def wakes(events: list[Event]) -> Iterator[tuple[Event, int]]:
    """(the sched_waking event, the thread woken)."""
    for e in events:
        if e.kind == "sched_waking":
            yield e, e.tid("pid")


@dataclass
class Mesh:
    """Who is who: each thread's process, and each process's role (gateway, coordinator, or a stage's index)."""

    process: dict[int, int]  # tid -> pid
    role: dict[int, str]  # pid -> "stage 0", "stage 1", "gateway", ...

    def stage_pids(self) -> list[int]:
        return sorted((p for p, r in self.role.items() if r.startswith("stage")), key=lambda p: self.role[p])


def compute_threads(events: list[Event], mesh: Mesh) -> dict[int, int]:
    """pid -> its compute thread, for the stages: the two threads of different stages that wake each other most."""
    stages = set(mesh.stage_pids())
    pairs: Counter[frozenset[int]] = Counter()
    for e, woken in wakes(events):
        a, b = mesh.process.get(e.current), mesh.process.get(woken)
        if a in stages and b in stages and a != b:
            pairs[frozenset((e.current, woken))] += 1
    if not pairs:
        raise SystemExit("no wake-ups between the two stages were traced: was the mesh serving?")
    return {mesh.process[t]: t for t in pairs.most_common(1)[0][0]}


def partners(spans: list[tuple[float, float, int, int]], mesh: Mesh, main: dict[int, int]) -> dict[int, int]:
    """pid -> the stage's other busiest thread in the trace (its OpenMP worker)."""
    cpu: Counter[int] = Counter()
    for s, e, _cpu, tid in spans:
        cpu[tid] += e - s
    out = {}
    for pid, m in main.items():
        rest = [t for t, p in mesh.process.items() if p == pid and t != m]
        out[pid] = max(rest, key=lambda t: cpu[t])
    return out


@dataclass(frozen=True)
class Turn:
    stage: int  # the pid whose turn it is
    start: float
    end: float
    handover_s: float | None  # the woken compute thread's wait to run
    partner_s: float | None  # from it running to its partner running
    cpu: dict[str, float]  # class -> seconds of CPU within the turn


def turns(events: list[Event], mesh: Mesh, gap_s: float = 0.1) -> list[Turn]:
    main = compute_threads(events, mesh)
    spans = running(events)
    partner = partners(spans, mesh, main)
    mains = set(main.values())
    marks = [(e.ts, mesh.process[w]) for e, w in wakes(events) if e.current in mains and w in mains and w != e.current]
    starts = [s[0] for s in spans]

    def kind(tid: int, pid: int) -> str:
        if tid == 0:
            return "idle"
        owner = mesh.process.get(tid)
        if owner == pid:
            return "compute thread" if tid == main[pid] else "partner" if tid == partner[pid] else "its other threads"
        if owner in main:
            return "the other stage"
        role = mesh.role.get(owner, "") if owner is not None else ""
        return role if role in ("gateway", "coordinator") else "other processes"

    out = []
    for (t0, pid), (t1, _) in itertools.pairwise(marks):
        if t1 - t0 > gap_s:  # between requests
            continue
        cpu: dict[str, float] = defaultdict(float)
        first_run = partner_run = None
        for j in range(bisect.bisect_left(starts, t0 - gap_s), len(spans)):
            s, e, _c, tid = spans[j]
            if s >= t1:
                break
            if e <= t0:
                continue
            cpu[kind(tid, pid)] += min(e, t1) - max(s, t0)
            if tid == main[pid] and first_run is None:
                first_run = max(s, t0)
            if tid == partner[pid] and partner_run is None and e > t0:
                partner_run = max(s, t0)
        handover = None if first_run is None else first_run - t0
        joined = None if first_run is None or partner_run is None else max(0.0, partner_run - first_run)
        out.append(Turn(pid, t0, t1, handover, joined, dict(cpu)))
    return out


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile); NaN for none (a stage whose partner never ran in its turns)."""
    v = sorted(values)
    if not v:
        return math.nan, math.nan, math.nan
    return v[len(v) // 4], statistics.median(v), v[(3 * len(v)) // 4]


CLASSES = ("compute thread", "partner", "its other threads", "the other stage", "gateway", "coordinator",
           "other processes", "idle")  # fmt: skip


def summary(found: list[Turn], mesh: Mesh) -> dict[str, dict]:
    out = {}
    for pid in mesh.stage_pids():
        mine = [t for t in found if t.stage == pid]
        if not mine:
            continue
        row = {"turns": len(mine), "wall_ms": quartiles([(t.end - t.start) * 1e3 for t in mine]),
               "wall_mean_ms": statistics.mean((t.end - t.start) * 1e3 for t in mine),
               "handover_ms": quartiles([t.handover_s * 1e3 for t in mine if t.handover_s is not None]),
               "partner_ms": quartiles([t.partner_s * 1e3 for t in mine if t.partner_s is not None]),
               "cpu_ms": {c: quartiles([t.cpu.get(c, 0.0) * 1e3 for t in mine]) for c in CLASSES},
               "cpu_mean_ms": {c: statistics.mean(t.cpu.get(c, 0.0) * 1e3 for t in mine) for c in CLASSES}}  # fmt: skip
        out[mesh.role[pid]] = row
    return out


def markdown(info: dict, a: argparse.Namespace, result: dict, found: dict[str, dict], tree: str = "") -> str:
    def q(x: tuple[float, float, float]) -> str:
        return f"{x[1]:.3f} ({x[0]:.3f}-{x[2]:.3f})"

    runs = f"{a.rounds} traced runs of three" if a.rounds > 1 else "three"
    lines = [
        f"{'#' if not tree or tree == 'this checkout' else '##'} A live pipeline's seams under the scheduler trace "
        f"({info['date'][:10]})" + (f": {tree}" if tree else ""),
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}. "
        "`shardmesh up --pp 2` (stages taking turns, 2 torch threads a worker, 8 decode steps a call), "
        f"`{a.model}` in {a.dtype}, greedy, "
        f"{runs} one-stream requests of {a.new_tokens} tokens traced: {result['ms_per_token']:.2f} ms a token "
        f"(mean inter-token time, the median of three requests, the median over runs; a pp=1 mesh beside it, "
        f"untraced: {', '.join(f'{x:.2f}' for x in result['pp1_ms_per_token'])} ms a token, before the first run and "
        "after each round), "
        f"{result['events']} events. Medians (quartiles) over the "
        "turns, ms; a turn runs from one stage's compute thread waking the other's to the wake-up back.",
        "",
        "| | " + " | ".join(found) + " |",
        "|---|" + "---:|" * len(found),
        "| turns | " + " | ".join(str(r["turns"]) for r in found.values()) + " |",
        "| wall | " + " | ".join(q(r["wall_ms"]) for r in found.values()) + " |",
        "| wall, mean (with the decode calls' round trips) | "
        + " | ".join(f"{r['wall_mean_ms']:.3f}" for r in found.values())
        + " |",
        "| woken compute thread running after | " + " | ".join(q(r["handover_ms"]) for r in found.values()) + " |",
        "| its partner running after that | " + " | ".join(q(r["partner_ms"]) for r in found.values()) + " |",
    ]
    for c in CLASSES:
        lines.append(f"| CPU: {c} | " + " | ".join(q(r["cpu_ms"][c]) for r in found.values()) + " |")
    lines += ["", "Mean CPU per turn, ms (the call boundaries included):", "",
              "| | " + " | ".join(found) + " |", "|---|" + "---:|" * len(found)]  # fmt: skip
    for c in CLASSES:
        lines.append(f"| {c} | " + " | ".join(f"{r['cpu_mean_ms'][c]:.3f}" for r in found.values()) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def _tracefs() -> Path:
    import os

    if os.geteuid() != 0:
        raise SystemExit("bench/seam_trace.py reads the kernel's scheduler trace: run it as root")
    if not (TRACEFS / "set_event").exists():
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=False, capture_output=True)
    if not (TRACEFS / "set_event").exists():
        raise SystemExit(f"no tracefs at {TRACEFS} (and mounting one failed): this kernel or container has no ftrace")
    return TRACEFS


def _who(root_pid: int, log_dir: Path) -> Mesh:
    import json

    import psutil

    stage_of = {}
    for log in log_dir.glob("worker*.log"):
        for line in log.read_text().splitlines():
            if '"event": "ready"' in line:
                stage_of[log.stem.replace("worker", "worker-")] = json.loads(line)["stage"]
    process, role = {}, {}
    for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]:
        args = p.cmdline()
        name = args[args.index("shardmesh_cli") + 1] if "shardmesh_cli" in args else "up"
        if name == "worker":  # a spare serves no stage: its threads count with the other processes
            stage = stage_of.get(args[args.index("--worker-id") + 1])
            name = "spare worker" if stage is None else f"stage {stage}"
        role[p.pid] = name
        for t in Path(f"/proc/{p.pid}/task").iterdir():
            process[int(t.name)] = p.pid
    return Mesh(process, role)


def trace_once(
    tracefs: Path, up: Any, log_dir: Path, prompt_ids: list[int], new_tokens: int
) -> tuple[dict, list[Event], Mesh]:
    """Three one-stream requests on `up` (a bench.run.Mesh) under the trace: what they measured, the events, and
    who is who in that mesh."""
    from bench.run import run_streams

    before = _who(up.proc.pid, log_dir)
    (tracefs / "buffer_size_kb").write_text("65536")
    (tracefs / "trace").write_text("")
    (tracefs / "set_event").write_text(EVENTS)
    (tracefs / "tracing_on").write_text("1")
    try:
        served = run_streams(up.address, prompt_ids, new_tokens, 1)  # three requests in a row
    finally:
        (tracefs / "tracing_on").write_text("0")
        (tracefs / "set_event").write_text("")
    events = parse((tracefs / "trace").read_text().splitlines())
    (tracefs / "trace").write_text("")
    after = _who(up.proc.pid, log_dir)  # threads started during the trace (the gateway's, gRPC's)
    return served, events, Mesh({**after.process, **before.process}, {**after.role, **before.role})


def per_round(found: list[Turn], mesh: Mesh, served: dict) -> dict[str, float]:
    """One traced run's headline numbers: ms a token, and each stage's median partner join and idle per turn."""
    out = {"ms_per_token": served["ms_per_token"]}
    for role, row in summary(found, mesh).items():
        out[f"{role} partner_ms"] = row["partner_ms"][1]
        out[f"{role} idle_ms"] = row["cpu_ms"]["idle"][1]
        out[f"{role} other_stage_ms"] = row["cpu_ms"]["the other stage"][1]
    return out


def against_markdown(rounds: list[dict[str, dict[str, float]]], names: list[str]) -> str:
    keys = [k for k in rounds[0][names[0]] if k != "ms_per_token"]
    lines = ["", "Per round (medians over that run's turns, ms):", "",
             "| round | tree | ms a token | " + " | ".join(keys) + " |",
             "|---:|---|---:|" + "---:|" * len(keys)]  # fmt: skip
    for i, r in enumerate(rounds, 1):
        for n in names:
            lines.append(
                f"| {i} | {n} | {r[n]['ms_per_token']:.2f} | " + " | ".join(f"{r[n][k]:.3f}" for k in keys) + " |"
            )
    lines += ["", f"{names[0]} less {names[1]}, median over rounds of the within-round differences (range):", ""]
    for k in ["ms_per_token", *keys]:
        d = [r[names[0]][k] - r[names[1]][k] for r in rounds]
        lines.append(f"- {k}: **{statistics.median(d):+.3f}** ({min(d):+.3f} to {max(d):+.3f})")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--against", default="", help="also trace commit REV's pipeline, alternated with this checkout's")
    ap.add_argument("--rounds", type=int, default=0, help="traced runs of each tree (default 1, with --against 4)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    a.rounds = a.rounds or (4 if a.against else 1)
    if a.new_tokens < 16 or a.rounds < 1:
        ap.error(f"--new-tokens must be at least 16, two decode calls, and --rounds at least 1 (got {a.new_tokens}, "
                 f"{a.rounds})")  # fmt: skip
    tracefs = _tracefs()
    from bench.run import Mesh as Up
    from bench.run import run_streams
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    names = ["this checkout", a.against] if a.against else ["this checkout"]
    pooled: dict[str, list[Turn]] = {n: [] for n in names}
    meshes_of: dict[str, Mesh] = {}
    rounds: list[dict[str, dict[str, float]]] = []
    served_all: dict[str, list[float]] = {n: [] for n in names}
    events_of: dict[str, int] = dict.fromkeys(names, 0)
    from bench.against import checked_out

    # the stack removes REV's worktree after the finally below has stopped the meshes that run from it
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        ups: dict[str, Any] = {}
        pp1 = None
        try:
            trees = {"this checkout": ROOT}
            if a.against:
                a.against_commit = stack.enter_context(checked_out(a.against, Path(logs) / "rev"))
                trees[a.against] = Path(logs) / "rev"
            for i, n in enumerate(names):
                (Path(logs) / f"pp2-{i}").mkdir()
                ups[n] = Up(model_dir, 2, 1, "auto", 16, Path(logs) / f"pp2-{i}", 2, "none", tree=trees[n],
                            extra=("--dtype", a.dtype))  # fmt: skip
            # pp=1 beside them, idle while a pipeline is traced: timed before the first trace and after each round
            (Path(logs) / "pp1").mkdir()
            pp1 = Up(model_dir, 1, 1, "auto", 16, Path(logs) / "pp1", 2, "none", extra=("--dtype", a.dtype))
            for m in (*ups.values(), pp1):
                run_streams(m.address, prompt_ids, 16, 1)  # warm-up
            pp1_ms = [run_streams(pp1.address, prompt_ids, a.new_tokens, 1)["ms_per_token"]]
            for r in range(a.rounds):
                row = {}
                for n in names if r % 2 == 0 else names[::-1]:
                    i = names.index(n)
                    served, events, mesh = trace_once(tracefs, ups[n], Path(logs) / f"pp2-{i}", prompt_ids,
                                                      a.new_tokens)  # fmt: skip
                    found = turns(events, mesh)
                    pooled[n] += found
                    meshes_of[n] = mesh  # the same processes every round: summary() reads their stages and roles
                    served_all[n].append(served["ms_per_token"])
                    events_of[n] += len(events)
                    row[n] = per_round(found, mesh, served)
                rounds.append(row)
                pp1_ms.append(run_streams(pp1.address, prompt_ids, a.new_tokens, 1)["ms_per_token"])
                print(f"round {r + 1}: {row}", flush=True)
        finally:
            for m in (*ups.values(), pp1):
                if m is not None:
                    m.close()
    md = []
    for n in names:
        found = summary(pooled[n], meshes_of[n])
        result = {"ms_per_token": statistics.median(served_all[n]), "pp1_ms_per_token": pp1_ms, "events": events_of[n]}
        title = n if n == "this checkout" else f"{n} ({a.against_commit[:10]})"
        md.append((title, result, found))
    text = "".join(markdown(info, a, result, found, title if a.against else "") for title, result, found in md)
    if a.against:
        text += against_markdown(rounds, names)
    data = {"args": vars(a), "trees": {t: {"result": r, "turns": f} for t, r, f in md}, "rounds": rounds}
    save_results(Path(a.out), info, "-seam-trace" + ("-against-" + a.against if a.against else ""), text, data)


if __name__ == "__main__":
    main()
