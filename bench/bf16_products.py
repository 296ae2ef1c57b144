"""bfloat16 products by each way this CPU has, in the same run: AMX tiles, AVX512-BF16's vdpbf16ps, and the weights
widened to float32 for FMAs.

    .venv/bin/python bench/bf16_products.py [--rows 1,4,16,64,736] [--rounds 5] [--iters 20] [--out bench/results]

The blocked product (`cpu_kernels.linear`) multiplies bfloat16 weights on AMX's tiles where the CPU has them and the
kernel grants a process their use (`SHARDMESH_CPU_AMX=0` turns them off); else, for one row, with vdpbf16ps; for two
rows or more with vdpbf16ps or widened, whichever a probe at load times faster on this core
(`cpu_kernels.choose_bf16_rows`; `SHARDMESH_CPU_BF16_ROWS` names one). Both environment variables are read once per
process, so each round runs one child process per way, in alternating order, each timing the same products:
SmolLM2-135M's, one layer's four (q, k, v stacked; o; gate and up stacked; down) and the LM head, random weights of a
fixed seed, at each row count (1: a decode step of one sequence, where widened is never taken, so its column there is
the noise between two runs of vdpbf16ps; 16: of 16; 736: a prefill of 16 x 46 tokens). A number is a child's median
µs per product over `--iters` calls, after one call of warm-up; the table gives each way's median over rounds and
its ratio to vdpbf16ps per round (their median; below 1 is faster). A last child reports what the probe chose with
neither variable set. Each child has PyTorch's default threads. Writes
bench/results/<host>-<date>-bf16-products.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import alternated, child_json, machine, save_results  # noqa: E402  (ROOT is on the path now)
from shardmesh.engine.cpu_kernels import AMX_ENV, BF16_ROWS_ENV  # noqa: E402

PRODUCTS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
# name: the environment that asks for it; vdpbf16ps, the baseline, first
WAYS = {
    "vdpbf16ps": {AMX_ENV: "0", BF16_ROWS_ENV: "vdpbf16ps"},
    "widened": {AMX_ENV: "0", BF16_ROWS_ENV: "widened"},
    "amx": {AMX_ENV: "1", BF16_ROWS_ENV: "vdpbf16ps"},
}


def child(rows: list[int], iters: int) -> dict:
    """The way this process took (`choose_bf16_rows`) and µs per product, '<name> <rows>': median over `iters`
    calls."""
    import time

    import torch

    from shardmesh.engine import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.build_error()
    chosen = cpu_kernels.choose_bf16_rows()
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, (n, k) in PRODUCTS.items():
        packed = cpu_kernels.pack(torch.randn(n, k, generator=g).to(torch.bfloat16))
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            cpu_kernels.linear(x, packed)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                cpu_kernels.linear(x, packed)
                times.append(time.perf_counter() - t0)
            out[f"{name} {m}"] = statistics.median(times) * 1e6
    return {"chosen": dataclasses.asdict(chosen), "us": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 4, 16, 64, 736])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.rows, a.iters)))
        return
    if a.rounds < 1 or a.iters < 1 or not a.rows or min(a.rows) < 1:
        p.error(f"--rounds, --iters and each of --rows must be at least 1 (got {a.rounds}, {a.iters}, {a.rows})")
    info = machine()
    if "avx512_bf16" not in info["cpu_flags"]:
        p.error(f"this CPU has no AVX512-BF16 (its flags that pick kernels: {' '.join(info['cpu_flags'])})")
    ways = [w for w in WAYS if w != "amx" or "amx_bf16" in info["cpu_flags"]]
    args = [sys.executable, __file__, "--child", "--rows", ",".join(map(str, a.rows)), "--iters", str(a.iters)]
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        got = {way: child_json(args, WAYS[way], f"{way} child") for way in alternated(ways, r)}
        for way, result in got.items():  # a way the kernel would not take (AMX refused) is not that way's number
            if result["chosen"]["way"] != way:
                sys.exit(f"asked for {way}, the kernels took {result['chosen']}")
        rounds.append({way: result["us"] for way, result in got.items()})
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
    auto = child_json([*args[:3], "--rows", "1", "--iters", "1"], {AMX_ENV: "", BF16_ROWS_ENV: ""}, "auto child")
    chosen = auto["chosen"]
    others = ways[1:]
    lines = [
        f"# bfloat16 products: {', '.join(ways)} ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, torch {info['torch']}; flags "
        f"{' '.join(info['cpu_flags'])}. SmolLM2-135M's products, random bfloat16 weights; each way in its own "
        f"process, alternated, {a.rounds} rounds; µs per product (median of {a.iters} calls, then over rounds); "
        "ratio: the median of the rounds' way ÷ vdpbf16ps. At one row widened is not taken (vdpbf16ps runs).",
        "",
        f"With neither variable set the kernels chose **{chosen['way']}**: {chosen['reason']}.",
        "",
        "| product (N x K) | rows | vdpbf16ps µs | " + " | ".join(f"{w} µs | {w} ÷ vdpbf16ps" for w in others) + " |",
        "|---|---:|---:|" + "---:|---:|" * len(others),
    ]
    rows = []
    for name, (n, k) in PRODUCTS.items():
        for m in a.rows:
            key = f"{name} {m}"
            base = statistics.median(r["vdpbf16ps"][key] for r in rounds)
            row = {"product": name, "n": n, "k": k, "rows": m, "vdpbf16ps_us": base}
            cells = []
            for w in others:
                us = statistics.median(r[w][key] for r in rounds)
                ratio = statistics.median(r[w][key] / r["vdpbf16ps"][key] for r in rounds)
                row |= {f"{w}_us": us, f"{w}_ratio": ratio}
                cells.append(f"{us:.1f} | {ratio:.2f}")
            rows.append(row)
            lines.append(f"| {name} ({n} x {k}) | {m} | {base:.1f} | " + " | ".join(cells) + " |")
    save_results(a.out, info, "-bf16-products", "\n".join(lines) + "\n",
                 {"args": vars(a) | {"out": str(a.out)}, "auto": chosen, "rows": rows, "rounds": rounds})  # fmt: skip


if __name__ == "__main__":
    main()
