"""A SmolLM2 decode step over the paged KV cache, through the compiled layer halves and through the eager model, beside
the slot cache's compiled step, in the same process and run.

    .venv/bin/python bench/paged_decode.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16] [--rows 1,16]
                                           [--context 200] [--block 16] [--rounds 6] [--steps 10]
                                           [--prefills 16x46,1x512] [--out bench/results]

The paged cache (`--kv-block-size`) decoded through the eager model until 2026-12-02: each layer's ~70 PyTorch calls
and the paged attention kernel (`paged_attention`). Now its decode rows go through the same one call of all the layers
as the slot cache's (`cpu_decode.CpuDecode.paged_rows`, `cpu_kernels.attend_paged`). Per dtype and row count, the
bench loads the model as one stage (2 threads), writes `--context` tokens of a prompt into each sequence's slot and,
in a second cache, into blocks of `--block` positions shuffled over the pool, then times `--steps` decode steps of
each way in turn, the ways' order reversed every round: `slot` (the slot cache, compiled, what a mesh without
--kv-block-size runs), `paged` (compiled) and `paged eager` (the model's forward on the paged cache). Then, per
`--prefills` entry (prompts x tokens), one step prefilling that many prompts from position 0, 3 times a way a round.
A line gives each way's median ms a step over all rounds and its ratio to `slot`'s (the median of the rounds'
ratios). Writes
bench/results/<host>-<date>-paged-decode.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import alternated, machine, save_results  # noqa: E402  (ROOT is on the path now)

WAYS = ["slot", "paged", "paged eager"]


def _meshless(model_dir: str, dtype_name: str, sequences: int, max_len: int, block: int) -> tuple:
    """The model as one stage (2 threads), a slot cache and a paged one for `sequences` sequences of `max_len`
    positions (each sequence's blocks shuffled over the pool, as a pool long in use hands them out), and the
    compiled runner of each: (model, tables, slot cache, paged cache, runners by way)."""
    import torch

    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.cpu_decode import cpu_decode
    from shardmesh.engine.loader import build_shard

    torch.set_num_threads(2)
    dtype = getattr(torch, dtype_name)
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    model = build_shard(model_dir, ShardSpec(0, layers, layers), dtype=dtype, progress=False, max_len=max_len)
    per_seq = -(-max_len // block)
    pool = list(range(sequences * per_seq))
    random.Random(0).shuffle(pool)
    tables = [tuple(pool[r * per_seq : (r + 1) * per_seq]) for r in range(sequences)]
    slots = model.make_cache(sequences, dtype, "cpu")
    paged = model.make_paged_cache(len(pool), block, dtype, "cpu")
    runners = {"slot": cpu_decode(model, slots, torch.device("cpu")),
               "paged": cpu_decode(model, paged, torch.device("cpu"))}  # fmt: skip
    return model, tables, slots, paged, runners


def _timed(model, paged, runners: dict, way: str, batch, ids) -> float:
    """ms of one step of `way`: the compiled runner (checked to take the step), or the model's eager forward."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        if way == "paged eager":
            model(ids, batch, paged)
        else:
            runner = runners[way]
            assert runner is not None and runner.accepts(batch, False), f"{way}: not the compiled path"
            runner.run(batch, ids)
    return (time.perf_counter() - t0) * 1e3


def measure(model_dir: str, dtype_name: str, rows: int, context: int, block: int, rounds: int,
            steps: int) -> dict[str, list[float]]:  # fmt: skip
    """Each way's ms per decode step, one value per round (the median of its `steps`)."""
    import torch

    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    model, tables, slots, paged, runners = _meshless(model_dir, dtype_name, rows, context + rounds * steps + 1, block)
    prompt = torch.randint(3, model.cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        for r in range(rows):
            model(prompt, BatchLayout.build([Segment(r, 0, context)]), slots)
            model(prompt, BatchLayout.build([Segment(0, 0, context, tables[r])], block_size=block), paged)
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    position = context
    for rnd in range(rounds):
        for way in alternated(WAYS, rnd):
            each = []
            for k in range(steps):
                at = position + k
                ids = torch.full((rows,), 5 + at % 50)
                if way == "slot":
                    batch = BatchLayout.build([Segment(r, at, 1) for r in range(rows)])
                else:
                    batch = BatchLayout.build([Segment(0, at, 1, tables[r]) for r in range(rows)], block_size=block)
                each.append(_timed(model, paged, runners, way, batch, ids))
            times[way].append(statistics.median(each))
        position += steps  # the next round writes the next positions: every way at the same lengths in a round
    return times


def measure_prefill(model_dir: str, dtype_name: str, prompts: int, length: int, block: int,
                    rounds: int) -> dict[str, list[float]]:  # fmt: skip
    """Each way's ms for one step of `prompts` prompts of `length` tokens, written from position 0 of fresh slots or
    blocks (one value per round, the median of 3 steps)."""
    import torch

    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    model, tables, _, paged, runners = _meshless(model_dir, dtype_name, prompts, length, block)
    ids = torch.randint(3, model.cfg.vocab_size, (prompts * length,), generator=torch.Generator().manual_seed(1))
    batches = {"slot": BatchLayout.build([Segment(r, 0, length) for r in range(prompts)])}
    batches["paged"] = batches["paged eager"] = BatchLayout.build(
        [Segment(0, 0, length, tables[r]) for r in range(prompts)], block_size=block)  # fmt: skip
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for rnd in range(rounds):
        for way in alternated(WAYS, rnd):
            times[way].append(statistics.median(_timed(model, paged, runners, way, batches[way], ids)
                                                for _ in range(3)))  # fmt: skip
    return times


def _summary(t: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, float], float]:
    """Each way's median ms over the rounds, the median of its rounds' ratios to `slot`'s, and the median of the
    rounds' eager ÷ compiled paged."""
    ms = {w: statistics.median(v) for w, v in t.items()}
    x = {w: statistics.median(v / s for v, s in zip(t[w], t["slot"], strict=True)) for w in WAYS}
    gain = statistics.median(e / c for e, c in zip(t["paged eager"], t["paged"], strict=True))
    return ms, x, gain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[1, 16])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument(
        "--prefills",
        default="16x46,1x512",
        help="prompts x tokens of each prefill step timed (comma-separated; empty: none)",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args()
    if min(a.rows) < 1 or a.context < 1 or a.block < 1 or a.rounds < 1 or a.steps < 1:
        p.error("--rows, --context, --block, --rounds and --steps must be at least 1")
    from shardmesh.models.registry import resolve

    model_dir = str(resolve(a.model))
    info = machine()
    lines = [
        f"# A decode step over the paged KV cache: compiled, eager, and the slot cache ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info['cpu_id']}), {info['cores']} cores, flags that pick kernels: "
        f"{' '.join(info['cpu_flags'])}; torch {info['torch']}. {a.model}, one stage, 2 threads, one process; "
        f"{a.context} tokens of context per sequence, blocks of {a.block} shuffled over the pool; {a.rounds} rounds "
        f"of {a.steps} steps per way, the ways' order reversed every round. ms a step (median over rounds); "
        f"x slot: the median of the rounds' ratios to the slot cache's compiled step.",
        "",
        "| dtype | rows | slot (compiled) | paged (compiled) | paged (eager) | paged eager ÷ paged compiled |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows_out = []
    for dtype in a.dtypes.split(","):
        for rows in a.rows:
            t = measure(model_dir, dtype, rows, a.context, a.block, a.rounds, a.steps)
            ms, x, gain = _summary(t)
            rows_out.append({"dtype": dtype, "rows": rows, "ms": ms, "x_slot": x, "eager_over_compiled": gain,
                             "rounds": t})  # fmt: skip
            lines.append(f"| {dtype} | {rows} | {ms['slot']:.2f} | {ms['paged']:.2f} ({x['paged']:.2f}x) | "
                         f"{ms['paged eager']:.2f} ({x['paged eager']:.2f}x) | {gain:.2f}x |")  # fmt: skip
            print(f"{dtype} {rows} rows done", file=sys.stderr)
        for spec in filter(None, a.prefills.split(",")):
            prompts, length = (int(v) for v in spec.split("x"))
            t = measure_prefill(model_dir, dtype, prompts, length, a.block, a.rounds)
            ms, x, gain = _summary(t)
            rows_out.append({"dtype": dtype, "prefill": spec, "ms": ms, "x_slot": x, "eager_over_compiled": gain,
                             "rounds": t})  # fmt: skip
            lines.append(
                f"| {dtype} | prefill {prompts} x {length} | {ms['slot']:.1f} | {ms['paged']:.1f} "
                f"({x['paged']:.2f}x) | {ms['paged eager']:.1f} ({x['paged eager']:.2f}x) | {gain:.2f}x |"
            )
            print(f"{dtype} prefill {spec} done", file=sys.stderr)
    save_results(a.out, info, "-paged-decode", "\n".join(lines) + "\n",
                 {"args": vars(a) | {"out": str(a.out)}, "rows": rows_out})  # fmt: skip


if __name__ == "__main__":
    main()
