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
import itertools
import math
import re
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

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
        for s, e, _c, tid in spans[max(0, bisect.bisect_left(starts, t0 - gap_s)) :]:
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


def markdown(info: dict, a: argparse.Namespace, result: dict, found: dict[str, dict]) -> str:
    def q(x: tuple[float, float, float]) -> str:
        return f"{x[1]:.3f} ({x[0]:.3f}-{x[2]:.3f})"

    lines = [
        f"# A live pipeline's seams under the scheduler trace ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}. "
        "`shardmesh up --pp 2` (stages taking turns, 2 torch threads a worker, 8 decode steps a call), "
        f"`{a.model}` in {a.dtype}, greedy, "
        f"three one-stream requests of {a.new_tokens} tokens traced: {result['ms_per_token']:.2f} ms a token "
        f"(mean inter-token time, median of the three; a pp=1 mesh beside it, untraced, "
        f"{result['pp1_ms_per_token'][0]:.2f} ms just before and {result['pp1_ms_per_token'][1]:.2f} just after), "
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
    import subprocess

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    if a.new_tokens < 16:
        ap.error(f"--new-tokens must be at least 16, two decode calls (got {a.new_tokens})")
    tracefs = _tracefs()
    from bench.run import Mesh as Up
    from bench.run import run_streams
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    with tempfile.TemporaryDirectory() as logs:
        (Path(logs) / "pp1").mkdir()
        up = Up(model_dir, 2, 1, "auto", 16, Path(logs), 2, "none", extra=("--dtype", a.dtype))
        pp1 = None
        try:
            # pp=1 beside it, idle while the pipeline is traced: its time per token just before and just after
            pp1 = Up(model_dir, 1, 1, "auto", 16, Path(logs) / "pp1", 2, "none", extra=("--dtype", a.dtype))
            for m in (up, pp1):
                run_streams(m.address, prompt_ids, 16, 1)  # warm-up
            pp1_ms = [run_streams(pp1.address, prompt_ids, a.new_tokens, 1)["ms_per_token"]]
            before = _who(up.proc.pid, Path(logs))
            (tracefs / "buffer_size_kb").write_text("65536")
            (tracefs / "trace").write_text("")
            (tracefs / "set_event").write_text(EVENTS)
            (tracefs / "tracing_on").write_text("1")
            try:
                served = run_streams(up.address, prompt_ids, a.new_tokens, 1)  # three requests in a row
            finally:
                (tracefs / "tracing_on").write_text("0")
                (tracefs / "set_event").write_text("")
            events = parse((tracefs / "trace").read_text().splitlines())
            (tracefs / "trace").write_text("")
            after = _who(up.proc.pid, Path(logs))  # threads started during the trace (the gateway's, gRPC's)
            mesh = Mesh({**after.process, **before.process}, {**after.role, **before.role})
            pp1_ms.append(run_streams(pp1.address, prompt_ids, a.new_tokens, 1)["ms_per_token"])
        finally:
            up.close()
            if pp1 is not None:
                pp1.close()
    found = summary(turns(events, mesh), mesh)
    result = {"ms_per_token": served["ms_per_token"], "pp1_ms_per_token": pp1_ms, "events": len(events)}
    save_results(Path(a.out), info, "-seam-trace", markdown(info, a, result, found),
                 {"args": vars(a), "result": result, "turns": found})  # fmt: skip


if __name__ == "__main__":
    main()
