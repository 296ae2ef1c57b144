"""Loading a shard as int8: the one-pass quantizer against the float64 tensors it replaced, and float32's load.

    .venv/bin/python bench/int8_load.py [--model smollm2-135m-instruct] [--rounds 3] [--out bench/results]

`--quantize int8` quantizes each product of a shard while loading it (`linear.quantize_groups`). On a CPU with the
blocked kernels that is one pass of compiled code (`cpu_kernels.quantize_groups`); elsewhere, and before it here,
some twenty float64 tensors of each matrix, 2^20 elements at a time (`linear._quantize_rows`). Each way loads the
whole model as one shard (`build_shard`, 2 threads) in a child process of its own, as a worker would:
- `one pass`: what the loader does on this CPU;
- `float64 tensors`: the same load with the one-pass quantizer turned off (the baseline);
- `float32`: the same checkpoint loaded without quantizing, for what a load costs anyway.
The ways alternate within each round, so the host's drift falls on all of them. The parent then quantizes every
product of the checkpoint both ways in one process and counts the groups whose numbers differ (0 is the claim).
Writes bench/results/<host>-<date>-int8-load.{md,json} and prints the markdown.
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

WAYS = ["one pass", "float64 tensors", "float32"]


def child(model_dir: str, way: str) -> dict:
    """Seconds to load the whole model as one shard the `way` asked for."""
    import time

    import torch

    from shardmesh.core.dtypes import Quantization
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine import linear
    from shardmesh.engine.loader import build_shard

    torch.set_num_threads(2)
    if way == "float64 tensors":
        linear.ONE_PASS_DTYPES = ()  # every product through `_quantize_rows`, as before the one-pass quantizer
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    quantization = Quantization.NONE if way == "float32" else Quantization.INT8
    t0 = time.perf_counter()
    model = build_shard(model_dir, ShardSpec(0, layers, layers), progress=False, quantization=quantization)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "kernels": model.linear_kernels}


def differing_groups(model_dir: str) -> dict:
    """Every 2-D weight of the checkpoint (the embedding too: a tied LM head is quantized from its matrix), quantized
    both ways: how many groups differ."""
    import torch
    from safetensors import safe_open

    from shardmesh.core.dtypes import INT8_GROUP
    from shardmesh.engine import cpu_kernels, linear

    matrices = groups = differing = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                w = f.get_tensor(name)
                if w.dim() != 2:
                    continue
                values, scale = cpu_kernels.quantize_groups(w, INT8_GROUP)
                ref_values, ref_scale = linear._quantize_rows(w, INT8_GROUP)
                n = scale.shape[1]
                padded = torch.nn.functional.pad(values != ref_values, (0, n * INT8_GROUP - w.shape[1]))
                bad = padded.view(w.shape[0], n, INT8_GROUP).any(2) | (scale != ref_scale).any(2)
                matrices, groups, differing = matrices + 1, groups + bad.numel(), differing + int(bad.sum())
    return {"matrices": matrices, "groups": groups, "differing": differing}


def report(info: dict, model: str, rounds: list[dict[str, float]], check: dict) -> tuple[str, dict]:
    """The markdown table and the JSON data of `rounds` (way -> seconds, one dict a round) and the equality check."""
    med = {w: statistics.median(r[w] for r in rounds) for w in WAYS}
    ratio = statistics.median(r["one pass"] / r["float64 tensors"] for r in rounds)
    beyond = {w: med[w] - med["float32"] for w in WAYS}
    lines = [
        f"# Loading {model} as int8: the one-pass quantizer against float64 tensors ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, torch {info['torch']}; the whole model as one "
        f"shard, each load in a child process of its own, the ways alternated, {len(rounds)} round(s).",
        "",
        "| load | seconds (median) | each round |",
        "|---|---:|---|",
    ]
    for w in WAYS:
        lines.append(f"| {w} | {med[w]:.2f} | {' / '.join(f'{r[w]:.2f}' for r in rounds)} |")
    lines += [
        "",
        f"one pass ÷ float64 tensors: **{ratio:.2f}×** (the median of the rounds' ratios). Quantizing beyond the "
        f"float32 load: {beyond['one pass']:.2f} s against {beyond['float64 tensors']:.2f} s.",
        "",
        f"Both ways on every product of the checkpoint in one process: {check['differing']} of {check['groups']} "
        f"groups differ ({check['matrices']} matrices).",
    ]
    return "\n".join(lines) + "\n", {"rounds": rounds, "medians": med, "ratio": ratio, "check": check}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # the way of a child run
    p.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.model_dir, a.child)))
        return
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    from shardmesh.engine import cpu_kernels
    from shardmesh.models.registry import resolve

    if not cpu_kernels.available():
        sys.exit(f"the one-pass quantizer needs the CPU kernels: {cpu_kernels.build_error()}")
    model_dir = str(resolve(a.model))
    info = machine()
    rounds: list[dict[str, float]] = []
    for r in range(a.rounds):
        got = {}
        for way in alternated(WAYS, r):
            got[way] = child_json([sys.executable, __file__, "--model-dir", model_dir, "--child", way], None,
                                  f"{way} load")["seconds"]  # fmt: skip
        rounds.append(got)
        print(f"round {r + 1} of {a.rounds}: {got}", file=sys.stderr)
    md, data = report(info, a.model, rounds, differing_groups(model_dir))
    save_results(a.out, info, "-int8-load", md, data)


if __name__ == "__main__":
    main()
