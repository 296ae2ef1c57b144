"""A whole SmolLM2 decode step and prefill by the CPU path that computes them, on this host, in the same run.

    .venv/bin/python bench/cpu_paths.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16] [--rows 1,16]
                                        [--prompt 256] [--rounds 3] [--steps 20] [--out bench/results]

The loader picks a shard's products from what the CPU has (`linear.choose_kernel`): the blocked kernels and the
compiled decode path (`cpu_decode`) where the kernels build for AVX-512 or AVX2, PyTorch's products and the eager
model elsewhere. This bench runs each path in a child process of its own, alternated round by round, on the same
checkpoint:
- `compiled`: what the loader picks here (the kernels built for this CPU's widest instructions);
- `eager`: PyTorch's products (`SHARDMESH_LINEAR_KERNEL`: oneDNN's packed product for float32, input-major for
  bfloat16) and the eager model, what a CPU without the kernels runs;
- `avx2` (CPUs with AVX-512 only): the kernels built without AVX-512 or AMX (`SHARDMESH_CPU_ISA=avx2`), what an AVX2
  server runs, measured on this one.
A child loads the whole model as one stage (2 threads), fills `--rows` cache slots with an 80-token prompt's keys and
values, then times decode steps (the median of `--steps` after 3 of warm-up, or of as many as fit in 20 s: the eager
bfloat16 path on a CPU without native bfloat16 takes seconds a step) and a prefill of `--prompt` tokens (the median of
3 after one, or of those that fit in 20 s). The
table gives each path's median over rounds and, per round, its time over `compiled`'s (the median of those ratios).
Writes bench/results/<host>-<date>-cpu-paths.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import alternated, child_json, machine, save_results  # noqa: E402  (ROOT is on the path now)
from shardmesh.engine.cpu_kernels import ISA_ENV  # noqa: E402
from shardmesh.engine.linear import KERNEL_ENV  # noqa: E402

CONTEXT = 80  # prompt tokens in each slot before the decode steps
STEP_BUDGET_S = 20.0  # a child stops timing steps past this (still at least 2 after warm-up)


def paths(dtype: str, flags: list[str]) -> dict[str, dict[str, str]]:
    """Each path's environment for a child of `dtype`."""
    ways = {"compiled": {}, "eager": {KERNEL_ENV: "onednn-packed" if dtype == "float32" else "input-major"}}
    if "avx512f" in flags:
        ways["avx2"] = {ISA_ENV: "avx2"}
    return ways


def child(model_dir: str, dtype_name: str, rows: list[int], prompt: int, steps: int) -> dict:
    """ms per decode step at each row count and per prefill, with the kernels the loader chose."""
    import time

    import torch

    from shardmesh.core.layout import ShardSpec
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout
    from shardmesh.engine.cpu_decode import cpu_decode
    from shardmesh.engine.loader import build_shard

    torch.set_num_threads(2)
    dtype = getattr(torch, dtype_name)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    model = build_shard(model_dir, ShardSpec(0, layers, layers), dtype=dtype, progress=False,
                        max_len=max(prompt, CONTEXT + steps + 8) + 8)  # fmt: skip
    out: dict = {"kernels": model.linear_kernels}
    with torch.inference_mode():
        for m in rows:
            cache = model.make_cache(m, dtype, "cpu")
            model(torch.arange(1, CONTEXT + 1), BatchLayout.build([Segment(0, 0, CONTEXT)]), cache)
            cache.data[:, :, 1:] = cache.data[:, :, :1]  # every slot holds the same prompt's keys and values
            runner = cpu_decode(model, cache, torch.device("cpu"))
            out["runner"] = "compiled" if runner is not None else "eager"
            times: list[float] = []
            start = time.perf_counter()
            for k in range(steps + 3):
                batch = BatchLayout.build([Segment(s, CONTEXT + k, 1) for s in range(m)])
                ids = torch.full((m,), 5 + k)
                t0 = time.perf_counter()
                runner.run(batch, ids) if runner is not None else model(ids, batch, cache)
                if k >= 3:
                    times.append(time.perf_counter() - t0)
                if len(times) >= 2 and time.perf_counter() - start > STEP_BUDGET_S:
                    break
            out[f"decode {m}"] = statistics.median(times) * 1e3
        cache = model.make_cache(1, dtype, "cpu")
        times, start = [], time.perf_counter()
        for k in range(4):
            t0 = time.perf_counter()
            model(torch.arange(1, prompt + 1), BatchLayout.build([Segment(0, 0, prompt)]), cache)
            if k:
                times.append(time.perf_counter() - t0)
            if times and time.perf_counter() - start > STEP_BUDGET_S:
                break
        out[f"prefill {prompt}"] = statistics.median(times) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 16])
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # dtype of a child run
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.model_dir, a.child, a.rows, a.prompt, a.steps)))
        return
    if a.rounds < 1 or a.steps < 1 or a.prompt < 1 or not a.rows or min(a.rows) < 1:
        p.error(f"--rounds, --steps, --prompt and each of --rows must be at least 1 (got {a.rounds}, {a.steps}, "
                f"{a.prompt}, {a.rows})")  # fmt: skip
    dtypes = a.dtypes.split(",")
    if not set(dtypes) <= {"float32", "bfloat16"}:
        p.error(f"--dtypes: float32 and/or bfloat16, not {a.dtypes!r}")
    from shardmesh.models.registry import resolve

    model_dir = str(resolve(a.model))
    info = machine()
    base = [sys.executable, __file__, "--model-dir", model_dir, "--rows", ",".join(map(str, a.rows)),
            "--prompt", str(a.prompt), "--steps", str(a.steps)]  # fmt: skip
    rounds: list[dict[str, dict[str, dict]]] = []
    for r in range(a.rounds):
        got: dict[str, dict[str, dict]] = {}
        for dtype in dtypes:
            ways = paths(dtype, info["cpu_flags"])
            got[dtype] = {way: child_json([*base, "--child", dtype], ways[way], f"{way} {dtype} child")
                          for way in alternated(list(ways), r)}  # fmt: skip
        rounds.append(got)
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
    lines = [
        f"# A decode step and a prefill by CPU path ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, flags that pick kernels: "
        f"{' '.join(info['cpu_flags'])}; torch {info['torch']}. {a.model}, one stage, 2 threads, each path in its "
        f"own process, alternated, {a.rounds} rounds. ms (median over rounds); x compiled: the median of the rounds' "
        f"ratios (above 1: slower than the compiled path).",
        "",
        "| dtype | path | products | " + " | ".join(f"decode, {m} rows" for m in a.rows)
        + f" | prefill, {a.prompt} tokens |",
        "|---|---|---|" + "---:|" * (len(a.rows) + 1),
    ]  # fmt: skip
    rows = []
    keys = [f"decode {m}" for m in a.rows] + [f"prefill {a.prompt}"]
    for dtype in dtypes:
        for way in paths(dtype, info["cpu_flags"]):
            cells, row = [], {"dtype": dtype, "path": way, "kernels": rounds[0][dtype][way]["kernels"]}
            for key in keys:
                ms = statistics.median(rd[dtype][way][key] for rd in rounds)
                ratio = statistics.median(rd[dtype][way][key] / rd[dtype]["compiled"][key] for rd in rounds)
                row[key] = {"ms": ms, "x_compiled": ratio}
                cells.append(f"{ms:.1f}" if way == "compiled" else f"{ms:.1f} ({ratio:.2f}x)")
            rows.append(row)
            kernels = ", ".join(row["kernels"])
            lines.append(f"| {dtype} | {way} | {kernels} | " + " | ".join(cells) + " |")
    save_results(a.out, info, "-cpu-paths", "\n".join(lines) + "\n",
                 {"args": vars(a) | {"out": str(a.out)}, "rows": rows, "rounds": rounds})  # fmt: skip


if __name__ == "__main__":
    main()
