"""Sampled requests against greedy ones on one mesh, in one run: what drawing costs a stream.

    .venv/bin/python bench/sampled_mesh.py [--dtype float32] [--rounds 4] [--ways penalties,logprobs] [--out DIR]

One `shardmesh up` (pp=1, this checkout), bench/run.py's request and 64 new tokens, the end of sequence ignored so
that every request decodes all of them. Each round sends, in turn (the order reversed every other round), one stream
(the median of 3) and a burst of 16 for each way of drawing: greedy, temperature 1 (OpenAI's default), and
temperature 0.7 with top-p 0.9, each seeded; `--ways` adds more (`EXTRA`): `penalties` (that draw with OpenAI's
frequency and presence penalties, and with a repetition penalty), `logprobs` (that draw asking 5 top log-probabilities
a token). The table gives each way's median over the rounds and its ratio to
greedy's: ms a token (above 1 is slower) and aggregate tokens/s (below 1 is slower).

Writes <out>/<host>-<date>-sampled-mesh-<dtype>.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402
from bench.run import Mesh, run_streams  # noqa: E402

WAYS = {
    "greedy": {"temperature": 0.0, "seed": 7},
    "temperature 1": {"temperature": 1.0, "seed": 7},
    "temperature 0.7, top-p 0.9": {"temperature": 0.7, "top_p": 0.9, "seed": 7},
}
EXTRA = {
    "penalties": {
        "t 0.7, p 0.9, frequency 0.5, presence 0.3": dict(
            temperature=0.7, top_p=0.9, seed=7, frequency_penalty=0.5, presence_penalty=0.3
        ),
        "t 0.7, p 0.9, repetition 1.1": {"temperature": 0.7, "top_p": 0.9, "seed": 7, "repetition_penalty": 1.1},
    },
    "logprobs": {"t 0.7, p 0.9, 5 top logprobs": {"temperature": 0.7, "top_p": 0.9, "seed": 7, "top_logprobs": 5}},
}
STREAMS = (1, 16)


def report(info: dict, dtype: str, rounds: int, runs: dict[str, dict[int, list[dict]]]) -> tuple[str, list[dict]]:
    """The markdown and the rows: each way's medians over the rounds, and their ratios to greedy's."""
    rows = []
    for way in runs:
        for n in STREAMS:
            ms = statistics.median(r["ms_per_token"] for r in runs[way][n])
            tok_s = statistics.median(r["aggregate_tok_s"] for r in runs[way][n])
            base_ms = statistics.median(r["ms_per_token"] for r in runs["greedy"][n])
            base_tok_s = statistics.median(r["aggregate_tok_s"] for r in runs["greedy"][n])
            rows.append({"way": way, "streams": n, "ms_per_token": ms, "aggregate_tok_s": tok_s,
                         "ms_ratio": ms / base_ms, "tok_s_ratio": tok_s / base_tok_s})  # fmt: skip
    lines = [
        f"## Sampled against greedy on one mesh — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"{info['date']}",
        "",
        f"SmolLM2 {dtype}, pp=1, 64 new tokens (end of sequence ignored), each way's median over {rounds} rounds, the "
        "ways alternated within each round on the same mesh. Ratios to greedy: ms/token above 1 is slower, tok/s "
        "below 1 is slower.",
        "",
        "| way | streams | ms/token | ÷ greedy | tok/s | ÷ greedy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['way']} | {r['streams']} | {r['ms_per_token']:.2f} | {r['ms_ratio']:.3f} | "
              f"{r['aggregate_tok_s']:.1f} | {r['tok_s_ratio']:.3f} |" for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n", rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--ways", default="", help=f"extra ways, comma-separated: {', '.join(EXTRA)}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = ap.parse_args()
    ways = dict(WAYS)
    for name in filter(None, a.ways.split(",")):
        if name not in EXTRA:
            ap.error(f"--ways: {name!r} is not one of {', '.join(EXTRA)}")
        ways.update(EXTRA[name])

    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer
    from shardmesh.rpc.procs import cores
    from shardmesh_cli.up import share_cores

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    share = share_cores(1, 1, "cpu", "auto", None, cores())
    info = machine()
    runs: dict[str, dict[int, list[dict]]] = {way: {n: [] for n in STREAMS} for way in ways}
    with tempfile.TemporaryDirectory() as logs:
        mesh = Mesh(model_dir, 1, 1, share.pipeline, max(STREAMS), Path(logs), share.worker_threads, "none",
                    extra=("--dtype", a.dtype))  # fmt: skip
        try:
            for r in range(a.rounds):
                for way in list(ways) if r % 2 == 0 else list(reversed(ways)):
                    for n in STREAMS:
                        runs[way][n].append(run_streams(mesh.address, prompt_ids, 64, n, sampling=ways[way]))
                print(f"round {r} done", file=sys.stderr)
        finally:
            mesh.close()
    md, rows = report(info, a.dtype, a.rounds, runs)
    suffix = "".join(f"-{w}" for w in filter(None, a.ways.split(",")))
    save_results(a.out, info, f"-sampled-mesh-{a.dtype}{suffix}", md, {"dtype": a.dtype, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
