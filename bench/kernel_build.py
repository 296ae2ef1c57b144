"""How long a first start spends compiling the C++ kernels: against `native.HEADERS` and against <torch/extension.h>.

    .venv/bin/python bench/kernel_build.py [--kernels link,shm,int8,paged,cpu] [--rounds 2] [--out bench/results]

Every kernel (`engine/native.py`) is compiled the first time a machine, a torch or a virtual environment meets it:
a fresh clone's first `make run` compiles the layers', the collectives' and the links' kernels before it serves, and
a fresh CI run compiles those and the rest. `load_inline` would put <torch/extension.h> first, which brings torch's
whole C++ frontend; the kernels are compiled against `native.HEADERS`, the few headers they use, instead.

Each build runs in a child process of its own, into an empty $TORCH_EXTENSIONS_DIR, with one of:
- `lean`: the kernel as the project builds it;
- `extension.h`: the same source with <torch/extension.h> before HEADERS, as `load_inline` compiles it by default
  (the baseline; the build is otherwise the same: its flags, its bindings, ninja).
The two alternate within each round, so the host's drift falls on both; the table gives each kernel's median seconds
over the rounds and their ratio. `cpu` is the layers' kernel built for this CPU's widest instructions.
Writes bench/results/<host>-<date>-kernel-build.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import alternated, child_json, machine, save_results  # noqa: E402  (ROOT is on the path now)

KERNELS = ["link", "shm", "int8", "paged", "cpu"]
WAYS = ["lean", "extension.h"]


def kernel(which: str) -> Any:
    """The InlineKernel named `which` (imported here: the child builds it after choosing its headers)."""
    from shardmesh.engine import cpu_kernels, int8_cpu, paged_attention, shm_collective, shm_link

    return {"link": shm_link._KERNEL, "shm": shm_collective._KERNEL, "int8": int8_cpu._KERNEL,
            "paged": paged_attention._KERNEL, "cpu": cpu_kernels.isa_kernel("native")}[which]  # fmt: skip


def child(which: str, way: str) -> dict:
    """Seconds to build kernel `which` (into this process's empty $TORCH_EXTENSIONS_DIR) the `way` asked for."""
    import time

    from shardmesh.engine import native

    if way == "extension.h":  # what load_inline compiles when it is left to put its own header first
        native.HEADERS = "#include <torch/extension.h>\n" + native.HEADERS
    k = kernel(which)
    t0 = time.perf_counter()
    module = k.module()
    seconds = time.perf_counter() - t0
    if module is None:
        raise SystemExit(f"{which} ({way}) did not build: {k.build_error}")
    return {"seconds": seconds}


def report(info: dict, kernels: list[str], rounds: list[dict[str, dict[str, float]]]) -> tuple[str, dict]:
    """The markdown table and the JSON data of `rounds` (kernel -> way -> seconds, one dict a round)."""
    lines = [
        f"# Building the C++ kernels: lean headers against <torch/extension.h> ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, torch {info['torch']}; each build in a child "
        f"process of its own into an empty build directory, the two ways alternated, {len(rounds)} round(s).",
        "",
        "| kernel | lean headers (s) | <torch/extension.h> (s) | lean ÷ extension.h |",
        "|---|---:|---:|---:|",
    ]
    medians: dict[str, dict[str, float]] = {}
    for k in kernels:
        medians[k] = {w: statistics.median(r[k][w] for r in rounds) for w in WAYS}
        ratio = statistics.median(r[k]["lean"] / r[k]["extension.h"] for r in rounds)
        medians[k]["ratio"] = ratio
        lines.append(f"| {k} | {medians[k]['lean']:.1f} | {medians[k]['extension.h']:.1f} | {ratio:.2f}× |")
    total = {w: sum(medians[k][w] for k in kernels) for w in WAYS}
    lines.append(f"| **all** | **{total['lean']:.1f}** | **{total['extension.h']:.1f}** | "
                 f"**{total['lean'] / total['extension.h']:.2f}×** |")  # fmt: skip
    return "\n".join(lines) + "\n", {"rounds": rounds, "medians": medians, "total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # "<kernel>:<way>"
    a = p.parse_args()
    if a.child:
        which, way = a.child.split(":", 1)
        print(json.dumps(child(which, way)))
        return
    kernels = a.kernels.split(",")
    if not kernels or not set(kernels) <= set(KERNELS):
        p.error(f"--kernels: some of {','.join(KERNELS)}, not {a.kernels!r}")
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    info = machine()
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        got: dict[str, dict[str, float]] = {}
        for k in kernels:
            got[k] = {}
            for way in alternated(WAYS, r):
                with tempfile.TemporaryDirectory(prefix="shardmesh-kernel-build-") as where:
                    env = {"TORCH_EXTENSIONS_DIR": where, "SHARDMESH_LOG_LEVEL": "warning"}
                    got[k][way] = child_json([sys.executable, __file__, "--child", f"{k}:{way}"], env,
                                             f"{k} {way} build")["seconds"]  # fmt: skip
        rounds.append(got)
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
    md, data = report(info, kernels, rounds)
    save_results(a.out, info, "-kernel-build", md, data)


if __name__ == "__main__":
    main()
