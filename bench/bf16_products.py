"""bfloat16 products on AMX tiles against AVX512-BF16's vdpbf16ps, on this host, in the same run.

    .venv/bin/python bench/bf16_products.py [--rows 1,4,16,64,736] [--rounds 5] [--iters 20] [--out bench/results]

The blocked product (`cpu_kernels.linear`) multiplies bfloat16 weights on AMX's tiles where the CPU has them and the
kernel grants a process their use, else with vdpbf16ps (`SHARDMESH_CPU_AMX=0` asks for the latter; the C++ reads it
once per process). So each round runs one child process per way, in alternating order, each timing the same products:
SmolLM2-135M's, one layer's four (q, k, v stacked; o; gate and up stacked; down) and the LM head, random weights of a
fixed seed, at each row count (1: a decode step of one sequence, 16: of 16, 736: a prefill of 16 x 46 tokens). A
number is a child's median µs per product over `--iters` calls, after one call of warm-up; the table gives each
way's median over rounds and the ratio AMX ÷ vdpbf16ps per round (its median; below 1 is faster). Each child has
PyTorch's default threads. Writes bench/results/<host>-<date>-bf16-products.{md,json} and prints the markdown.
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
from shardmesh.engine.cpu_kernels import AMX_ENV  # noqa: E402

PRODUCTS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
WAYS = {"amx": "1", "vdpbf16ps": "0"}  # name: $SHARDMESH_CPU_AMX (`cpu_kernels.AMX_ENV`)


def child(rows: list[int], iters: int) -> dict[str, float]:
    """µs per product, '<name> <rows>': median over `iters` calls."""
    import time

    import torch

    from shardmesh.engine import cpu_kernels

    assert cpu_kernels.available(), cpu_kernels.build_error()
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
    return out


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
    if "amx_bf16" not in info["cpu_flags"]:
        p.error(f"this CPU has no AMX-BF16 (its flags that pick kernels: {' '.join(info['cpu_flags'])})")
    args = [sys.executable, __file__, "--child", "--rows", ",".join(map(str, a.rows)), "--iters", str(a.iters)]
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(a.rounds):
        rounds.append(
            {way: child_json(args, {AMX_ENV: WAYS[way]}, f"{way} child") for way in alternated(list(WAYS), r)}
        )
        print(f"round {r + 1} of {a.rounds}", file=sys.stderr)
    lines = [
        f"# bfloat16 products: AMX tiles against vdpbf16ps ({info['date'][:10]})",
        "",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}; SmolLM2-135M's products, random bfloat16 "
        f"weights; each way in its own process, alternated, {a.rounds} rounds; µs per product (median of "
        f"{a.iters} calls, then over rounds); ratio: the median of the rounds' AMX ÷ vdpbf16ps.",
        "",
        "| product (N x K) | rows | AMX µs | vdpbf16ps µs | AMX ÷ vdpbf16ps |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = []
    for name, (n, k) in PRODUCTS.items():
        for m in a.rows:
            key = f"{name} {m}"
            amx = statistics.median(r["amx"][key] for r in rounds)
            vdp = statistics.median(r["vdpbf16ps"][key] for r in rounds)
            ratio = statistics.median(r["amx"][key] / r["vdpbf16ps"][key] for r in rounds)
            rows.append({"product": name, "n": n, "k": k, "rows": m, "amx_us": amx, "vdpbf16ps_us": vdp,
                         "ratio": ratio})  # fmt: skip
            lines.append(f"| {name} ({n} x {k}) | {m} | {amx:.1f} | {vdp:.1f} | {ratio:.2f} |")
    save_results(a.out, info, "-bf16-products", "\n".join(lines) + "\n", {"args": vars(a) | {"out": str(a.out)},
                                                                          "rows": rows, "rounds": rounds})  # fmt: skip


if __name__ == "__main__":
    main()
