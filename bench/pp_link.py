"""Latency of a pipeline hop on this host: a shared-memory link against a Gloo one, in the same run.

    .venv/bin/python bench/pp_link.py [--hidden 576] [--tokens 1,16] [--iters 500] [--rounds 5]

Writes bench/results/<host>-<date>-pp-link.{md,json} and prints the markdown. Two processes (spawned here, one
store served by this process) form two pairs of links the way pipeline stages do (`groups.form_link`): a forward
link from A to B and a link back from B to A, with SHARDMESH_LINK_TRANSPORT=shm, with gloo, and with shm once more
whose sender checks that its receiver lives as where no pidfd can be had (kill(pid, 0) and /proc: the same run's
baseline for the pidfd check). What one round trip carries is a two-stage pipeline's decode step: `tokens` rows of
`--hidden` float32 forward (576: SmolLM2-135M), one int64 token id per row back, as the last stage returns what it
drew to the first. A number is A's mean µs per round trip over `--iters` back-to-back trips, halved (one hop), and
the table gives the median over `--rounds` rounds; the transports rotate round by round, so drift on a shared
machine hits them alike. Each process has one intra-op thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, spawned  # noqa: E402  (the repository root is on the path only now)
from bench.tp_allreduce import report, transport_args  # noqa: E402

TIMEOUT = timedelta(seconds=120)
# "shm no pidfd": the ring with its liveness check before every send done as without a pidfd (kill(pid, 0) and a read
# of /proc), the way every ring checked its peer before pidfds: the same run's baseline for what the pidfd saves.
TRANSPORTS = ("shm", "shm no pidfd", "gloo")
NO_PIDFD = "shm no pidfd"


def side_main(port: int, me: int, a: dict[str, Any], out: Any) -> None:
    """Process A (me 0) or B (me 1): form both transports' links, then time round trips; A reports."""
    os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
    import torch
    import torch.distributed as dist

    from shardmesh.engine import shm_link
    from shardmesh.engine.groups import StageLink, form_link

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=TIMEOUT)
    cpu = torch.device("cpu")
    links: dict[str, tuple[StageLink, StageLink]] = {}
    with_pidfd = shm_link.pidfd
    for name in TRANSPORTS:
        os.environ[shm_link.TRANSPORT_ENV] = "shm" if name == NO_PIDFD else name
        shm_link.pidfd = (lambda pid: -1) if name == NO_PIDFD else with_pidfd
        # forward: A is side 0 (sends); back: B is side 0 (sends)
        fwd, fplan = form_link(store, f"bench/{name}/fwd", me, cpu, "auto", TIMEOUT, "the other process")
        back, bplan = form_link(store, f"bench/{name}/back", 1 - me, cpu, "auto", TIMEOUT, "the other process")
        assert fplan.backend == bplan.backend == name.split()[0], (fplan, bplan)
        links[name] = (StageLink(fwd, is_sender=me == 0, plan=fplan), StageLink(back, is_sender=me == 1, plan=bplan))
    samples: dict[str, list[float]] = {f"{name} {tokens}": [] for tokens in a["tokens"] for name in TRANSPORTS}
    for r in range(a["rounds"]):
        for tokens in a["tokens"]:
            x = torch.randn(tokens, a["hidden"])
            drawn = torch.arange(tokens, dtype=torch.int64)
            for name in TRANSPORTS[r % len(TRANSPORTS) :] + TRANSPORTS[: r % len(TRANSPORTS)]:
                fwd_link, back_link = links[name]
                for i in range(5 + a["iters"]):  # 5 trips of warm-up before the clock starts
                    if i == 5:
                        t0 = time.perf_counter()
                    if me == 0:
                        fwd_link.send(x)
                        back_link.recv((tokens,), torch.int64, cpu)
                    else:
                        fwd_link.recv((tokens, a["hidden"]), torch.float32, cpu)
                        back_link.send(drawn)
                samples[f"{name} {tokens}"].append((time.perf_counter() - t0) / a["iters"] / 2 * 1e6)
    if me == 0:
        out.put({"transport": links["shm"][0].wire.describe(), "samples": samples, "variants": [NO_PIDFD]})


def run(a: argparse.Namespace) -> dict[str, Any]:
    args = {"hidden": a.hidden, "tokens": a.tokens, "iters": a.iters, "rounds": a.rounds}
    return spawned(side_main, 2, args, TIMEOUT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    transport_args(p, iters=500)
    a = p.parse_args()
    if a.iters < 1 or a.rounds < 1:
        p.error(f"--iters and --rounds must be at least 1 (got {a.iters}, {a.rounds})")
    result = run(a)
    info = machine()
    head = [
        f"# A pipeline hop on one host: shared memory vs Gloo ({info['date'][:10]})",
        "",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}; two processes, one intra-op thread each; "
        f"a round trip is `tokens` {a.hidden}-wide float32 rows forward (bytes below) and `tokens` int64 ids back; "
        f"{a.iters} round trips per round, halved (one hop), median of {a.rounds} rounds. shm: {result['transport']}.",
    ]
    report(a, result, "-pp-link", head, "per hop")


if __name__ == "__main__":
    main()
