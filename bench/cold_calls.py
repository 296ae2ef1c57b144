"""What a stage's small calls cost after it has been away: the seam's calls are cold, but cold from what?

    .venv/bin/python bench/cold_calls.py [--gaps-ms 0,0.3,1,4,15] [--pairs 60] [--rounds 4] [--out bench/results]

Two processes (one torch thread each) joined by a shared-memory link the way pipeline stages are (`form_link`). Before
each timed call, side A does one of:
- a busy wait of G ms in Python (`--gaps-ms`: 0 is the warm baseline): a loop that touches almost no memory;
- a sleep of the longest gap;
- a read of 300 MB (`--read-mb`, a sum, as a forward streams its weights), on 4 KiB pages and on transparent huge
  pages (madvise; the table says whether the kernel gave them);
then times one copy of one token's hidden state (576 float32, `Tensor.copy_`, the smallest torch call) and one send
of it over the link (`StageLink.send`: a poll of the peer's pidfd, a copy into the ring, a futex wake-up), while side
B waits for it (asleep on the futex, or spinning: `--spin-recv`). The conditions rotate within each round, so the
host's drift falls on all of them; each number is a median over `--pairs` calls and the rounds, set against the warm
baseline of the same run.

Why: in a pipeline whose stages take turns, every hop and each stage's Python between forwards took several times
its time between idle processes (docs/performance.md, "the seam, stamp by stamp"), which was put down to the
forward's 270 MB evicting the caches. This separates the stream of memory from time passing.
Writes bench/results/<host>-<date>-cold-calls.{md,json}.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results, spawned  # noqa: E402  (the repository root is on the path now)

TIMEOUT = timedelta(seconds=120)
HIDDEN = 576  # SmolLM2-135M's hidden size


def _buffer(mb: int, huge: bool) -> tuple[Any, Any]:
    """A float32 tensor over `mb` MiB of anonymous memory, advised onto huge pages or kept off them, touched."""
    import torch

    mm = mmap.mmap(-1, mb << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.float32)
    t.fill_(1.0)
    return mm, t


def _huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def side_main(port: int, me: int, a: dict[str, Any], out: Any) -> None:
    """Side A (me 0) times; side B receives every send."""
    os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
    os.environ["SHARDMESH_LINK_TRANSPORT"] = "shm"
    import torch
    import torch.distributed as dist

    from shardmesh.engine.groups import StageLink, form_link

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    cpu = torch.device("cpu")
    wire, plan = form_link(store, "cold/fwd", me, cpu, "auto", TIMEOUT, "the other process")
    link = StageLink(wire, is_sender=me == 0, plan=plan)
    if a["spin_recv"] and me == 1:
        link.wire.spin_s = 3600.0  # B polls the ring instead of sleeping: no wake-up to pay on A's side
    x, y = torch.randn(1, HIDDEN), torch.empty(1, HIDDEN)
    conditions = [f"busy {g:g} ms" for g in a["gaps_ms"]] + [f"sleep {max(a['gaps_ms']):g} ms"]
    reads = {f"read {a['read_mb']} MB, {'huge' if huge else '4 KiB'} pages": huge for huge in (False, True)}
    conditions += list(reads)
    buffers = {name: _buffer(a["read_mb"], huge) for name, huge in reads.items()} if me == 0 else {}
    huge_kib = _huge_kib()
    times: dict[str, dict[str, list[float]]] = {c: {"copy": [], "send": []} for c in conditions}
    for r in range(a["rounds"]):
        order = conditions[r % len(conditions) :] + conditions[: r % len(conditions)]
        for c in order:
            for _ in range(a["pairs"]):
                if me == 1:
                    link.recv((1, HIDDEN), torch.float32, cpu)
                    continue
                if c in buffers:
                    buffers[c][1].sum()
                elif c.startswith("sleep"):
                    time.sleep(max(a["gaps_ms"]) / 1e3)
                else:
                    end = time.perf_counter() + float(c.split()[1]) / 1e3
                    while time.perf_counter() < end:
                        pass
                t0 = time.perf_counter()
                y.copy_(x)
                t1 = time.perf_counter()
                link.send(x)
                t2 = time.perf_counter()
                times[c]["copy"].append((t1 - t0) * 1e6)
                times[c]["send"].append((t2 - t1) * 1e6)
    if me == 0:
        out.put({"conditions": conditions, "times_us": times, "huge_kib": huge_kib, "link": link.wire.describe()})


def markdown(info: dict, a: argparse.Namespace, got: dict[str, Any]) -> str:
    times, warm = got["times_us"], got["conditions"][0]
    base = {k: statistics.median(times[warm][k]) for k in ("copy", "send")}
    lines = [
        f"# Small calls after time away, against the same calls warm ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}, load average "
        f"{info.get('load_avg_1m')} at the start. Two processes, one torch thread each, a {got['link']} link; side B "
        f"{'spins on the ring' if a.spin_recv else 'sleeps on the futex'} while it waits. {a.rounds} rounds of "
        f"{a.pairs} calls per condition, rotated; medians (quartiles in brackets). The huge-page buffer held "
        f"{got['huge_kib'] >> 10} MiB of huge pages.",
        "",
        "| before the call | `copy_` of 576 float32, µs | ÷ warm | `StageLink.send`, µs | ÷ warm |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in got["conditions"]:
        cells = []
        for k in ("copy", "send"):
            v = times[c][k]
            q = statistics.quantiles(v, n=4)
            m = statistics.median(v)
            cells += [f"{m:.1f} ({q[0]:.1f} to {q[2]:.1f})", f"{m / base[k]:.1f}×"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gaps-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.3, 1, 4, 15])
    ap.add_argument("--read-mb", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--spin-recv", action="store_true", help="side B spins on the ring instead of sleeping")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    if a.pairs < 1 or a.rounds < 1 or a.read_mb < 1 or min(a.gaps_ms) < 0 or a.gaps_ms[0] != 0:
        ap.error(f"--pairs, --rounds and --read-mb must be positive and --gaps-ms start at 0, the warm baseline (got "
                 f"{a.pairs}, {a.rounds}, {a.read_mb}, {a.gaps_ms})")  # fmt: skip
    info = machine()
    got = spawned(side_main, 2, {"gaps_ms": a.gaps_ms, "read_mb": a.read_mb, "pairs": a.pairs, "rounds": a.rounds,
                                 "spin_recv": a.spin_recv}, TIMEOUT)  # fmt: skip
    suffix = "-cold-calls" + ("-spin-recv" if a.spin_recv else "")
    save_results(Path(a.out), info, suffix, markdown(info, a, got), {"args": vars(a), **got})


if __name__ == "__main__":
    main()
