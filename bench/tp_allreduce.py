"""Latency of one tensor-parallel all-reduce on this host: shared memory against Gloo, in the same run.

    .venv/bin/python bench/tp_allreduce.py [--ranks 3] [--hidden 576] [--tokens 1,16] [--iters 200] [--rounds 5]

Writes bench/results/<host>-<date>-tp-allreduce.{md,json} and prints the markdown. `--ranks` processes (spawned
here, one store served by this process) form a CPU tensor-parallel group the way a worker does
(`groups.form_tp_collective`, SHARDMESH_TP_TRANSPORT=shm): a `ShmCollective` over a /dev/shm segment, with the
group's Gloo `GroupCollective` behind it (`.fallback`), so both transports join the same ranks. What is reduced is
a decode step's hidden state: `tokens` rows of `--hidden` float32 (576: SmolLM2-135M), one token and 16. Each
round times `--iters` back-to-back all-reduces over shm, then as many over Gloo, for each size; a number is rank
0's mean µs per all-reduce in a round, and the table gives the median over `--rounds` rounds (the two transports
alternate round by round, so drift on a shared machine hits both alike). Every rank runs with one intra-op
thread; with more ranks than cores (3 on 2 cores, say) the ranks take turns on the cores, which is the case the
shared-memory wait's yielding and sleeping is for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results, spawned  # noqa: E402  (the repository root is on the path only now)

TIMEOUT = timedelta(seconds=120)


def rank_main(port: int, rank: int, a: dict[str, Any], out: Any) -> None:
    """One rank: form the group, then for every round and size time shm and Gloo in turn; rank 0 reports."""
    os.environ["SHARDMESH_TP_TRANSPORT"] = "shm"
    os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
    import torch
    import torch.distributed as dist

    from shardmesh.engine.groups import form_tp_collective

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    shm = form_tp_collective(store, "bench/tp", rank, a["ranks"], torch.device("cpu"), TIMEOUT)
    transports = {"shm": shm, "gloo": shm.fallback}
    samples: dict[str, list[float]] = {f"{name} {tokens}": [] for tokens in a["tokens"] for name in transports}
    for _ in range(a["rounds"]):
        for tokens in a["tokens"]:
            x = torch.randn(tokens, a["hidden"])
            for name, group in transports.items():
                for _ in range(5):  # warm-up: every rank in the loop before the clock starts
                    group.all_reduce(x.clone())
                inputs = [x.clone() for _ in range(a["iters"])]
                t0 = time.perf_counter()
                for y in inputs:
                    group.all_reduce(y)
                samples[f"{name} {tokens}"].append((time.perf_counter() - t0) / a["iters"] * 1e6)
    if rank == 0:
        out.put({"transport": shm.describe(), "samples": samples})


def run(a: argparse.Namespace) -> dict[str, Any]:
    args = {"ranks": a.ranks, "hidden": a.hidden, "tokens": a.tokens, "iters": a.iters, "rounds": a.rounds}
    return spawned(rank_main, a.ranks, args, TIMEOUT)


def transport_args(p: argparse.ArgumentParser, iters: int) -> None:
    """The options this bench and bench/pp_link.py share: what is moved, how often, where the results go."""
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 16])
    p.add_argument("--iters", type=int, default=iters)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")


def report(a: argparse.Namespace, result: dict[str, Any], suffix: str, head: list[str], unit: str) -> None:
    """The median over rounds of each transport's µs per `unit` at each token count, shared memory beside Gloo (and
    beside each variant named in `result["variants"]`), under `head` (the title and what was run), saved as
    <out>/<host>-<date><suffix>.{md,json}."""
    med = {k: statistics.median(v) for k, v in result["samples"].items()}
    names = ["shm", *result.get("variants", []), "gloo"]
    rows = [{"tokens": t, "bytes": t * a.hidden * 4, **{f"{n}_us": med[f"{n} {t}"] for n in names}} for t in a.tokens]
    titles = {"shm": "shm", "gloo": "Gloo"}
    lines = [
        *head,
        "",
        "| tokens | bytes | " + "".join(f"{titles.get(n, n)} µs {unit} | " for n in names) + "Gloo / shm |",
        "|---:|---:|" + "---:|" * len(names) + "---:|",
    ]
    for r in rows:
        cells = "".join(f"{r[f'{n}_us']:.1f} | " for n in names)
        lines.append(f"| {r['tokens']} | {r['bytes']} | {cells}{r['gloo_us'] / r['shm_us']:.1f}x |")
    data = {"args": {k: str(v) for k, v in vars(a).items()}, "transport": result["transport"], "rows": rows,
            "samples_us": result["samples"]}  # fmt: skip
    save_results(a.out, machine(), suffix, "\n".join(lines) + "\n", data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3)
    transport_args(p, iters=200)
    a = p.parse_args()
    if a.ranks < 2 or a.iters < 1 or a.rounds < 1:
        p.error(f"--ranks must be at least 2 (got {a.ranks}), --iters and --rounds at least 1 "
                f"(got {a.iters}, {a.rounds})")  # fmt: skip
    result = run(a)
    info = machine()
    head = [
        f"# Tensor-parallel all-reduce on one host: shared memory vs Gloo ({info['date'][:10]})",
        "",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}; {a.ranks} rank processes, one intra-op "
        f"thread each; {a.hidden}-wide float32 rows; {a.iters} all-reduces per round, median of {a.rounds} rounds "
        f"(rank 0's mean per all-reduce). shm: {result['transport']}.",
    ]
    report(a, result, "-tp-allreduce", head, "per all-reduce")


if __name__ == "__main__":
    main()
