"""The pipeline's seams, measured side by side: pp=1 against pp=2 (`up`'s default on CPU: stages taking turns), each
as `up` runs it (compute threads at real-time priority where the OS allows it, `--compute-priority auto`) and with
`--compute-priority normal`, all four meshes up at once.

    .venv/bin/python bench/pipeline_seams.py [--model smollm2-135m-instruct] [--dtype float32] [--rounds 8]
                                             [--streams 16] [--new-tokens 64] [--out bench/results]

Why a bench of its own: bench/run.py starts its meshes one after another, and on the virtual machines here a decode
step's time moves by 15-30% from one minute to the next, so its stage boundary (pp=2 minus pp=1, ~35 ms a token each)
ranged from -4.9 to +9.2 ms over four rounds, where the target is 0.5 ms. Here the meshes stay up and every
round runs each of them once, in an order that rotates from round to round, back to back: one stream (the median of
3 requests' mean inter-token ms) and then `--streams` concurrent streams (their aggregate tokens/s). Each derived
number is computed within a round and reported as the median over the rounds, with its range:
- stage boundary: pp=2's ms/token minus pp=1's, one stream (target <= 0.5 ms);
- pp=2 ÷ pp=1 at `--streams` streams, aggregate tokens/s (target >= 0.9x);
each pp=2 against the pp=1 of its own priority, and pp=1 at normal priority against pp=1 as `up` runs it.
Every mesh runs `shardmesh up` as deployed (2 torch threads a worker on this host's cores, 8 decode steps per call);
the last two differ only by `--compute-priority normal`. The links and the compute threads' priority each mesh's
workers used are read from their logs (`SHARDMESH_LINK_TRANSPORT=gloo` in this process's environment puts every
pipeline's links on Gloo). Writes bench/results/<host>-<date>-pipeline-seams-<dtype>.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import PROMPT, machine, save_results  # noqa: E402  (the repository root is on the path only now)
from bench.run import Mesh, run_streams  # noqa: E402

MESHES = {  # name: (pp, `up`'s own flags)
    "pp=1": (1, ()),
    "pp=2": (2, ()),
    "pp=2 normal priority": (2, ("--compute-priority", "normal")),
    "pp=1 normal priority": (1, ("--compute-priority", "normal")),
}
BASELINE = {"pp=2": "pp=1", "pp=2 normal priority": "pp=1 normal priority", "pp=1 normal priority": "pp=1"}


def measure(mesh: Mesh, prompt_ids: list[int], a: argparse.Namespace) -> dict[str, float]:
    one = run_streams(mesh.address, prompt_ids, a.new_tokens, 1)
    many = run_streams(mesh.address, prompt_ids, a.new_tokens, a.streams)
    return {"ms_per_token": one["ms_per_token"], "aggregate_tok_s": many["aggregate_tok_s"]}


def derived(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, base in BASELINE.items():
        boundary = [r[name]["ms_per_token"] - r[base]["ms_per_token"] for r in rounds]
        ratio = [r[name]["aggregate_tok_s"] / r[base]["aggregate_tok_s"] for r in rounds]
        out[name] = {"against": base,
                     "boundary_ms": statistics.median(boundary), "boundary_range": [min(boundary), max(boundary)],
                     "ratio": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)],
                     "boundary_each": boundary, "ratio_each": ratio}  # fmt: skip
    return out


def markdown(info: dict, a: argparse.Namespace, rounds: list[dict], found: dict, links: dict[str, list[str]],
             priority: dict[str, list[str]]) -> str:  # fmt: skip
    lines = [
        f"# The pipeline's seams: pp=1 and pp=2 side by side ({info['date'][:10]})",
        "",
        f"{info['cpu']} ({info.get('cpu_id', '')}), {info['cores']} cores, torch {info['torch']}, load average "
        f"{info.get('load_avg_1m')} at the start. Model `{a.model}` in {a.dtype}, greedy, the chat prompt of "
        f"{PROMPT!r}, {a.new_tokens} new tokens. {len(MESHES)} meshes up at once (`shardmesh up --rebalance none`, "
        f"2 torch threads a worker, 8 decode steps per call); {a.rounds} rounds, each running every mesh once in a "
        f"rotating order: one stream (median of 3 requests) and {a.streams} streams. Links per mesh (from the workers' "
        f"logs): " + "; ".join(f"{k}: {'/'.join(v) or 'none'}" for k, v in links.items()) + ". Compute threads' "
        "priority per mesh: " + "; ".join(f"{k}: {'/'.join(v) or 'not logged'}" for k, v in priority.items()) + ".",
        "",
        f"| round | {' | '.join(f'{n} ms/token' for n in MESHES)} | "
        f"{' | '.join(f'{n} tok/s at {a.streams}' for n in MESHES)} |",
        "|---:|" + "---:|" * (2 * len(MESHES)),
    ]
    for i, r in enumerate(rounds, 1):
        lines.append(f"| {i} | " + " | ".join(f"{r[n]['ms_per_token']:.2f}" for n in MESHES) + " | "
                     + " | ".join(f"{r[n]['aggregate_tok_s']:.1f}" for n in MESHES) + " |")  # fmt: skip
    lines += ["", "Medians of the per-round values (range over rounds):", ""]
    for name, d in found.items():
        lo, hi = d["boundary_range"]
        rlo, rhi = d["ratio_range"]
        if name.startswith("pp=1"):
            lines.append(
                f"- {name} against {d['against']}: **{d['boundary_ms']:+.2f} ms** per token ({lo:+.2f} to "
                f"{hi:+.2f}); tokens/s at {a.streams} streams **{d['ratio']:.2f}×** ({rlo:.2f} to {rhi:.2f})"
            )
            continue
        lines.append(f"- {name} against {d['against']}: stage boundary **{d['boundary_ms']:+.2f} ms** per token "
                     f"({lo:+.2f} to {hi:+.2f}; target <= 0.5 ms); pp=2 ÷ pp=1 at {a.streams} streams "
                     f"**{d['ratio']:.2f}×** ({rlo:.2f} to {rhi:.2f}; target >= 0.9×)")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    if a.rounds < 1 or a.streams < 2:
        ap.error(f"--rounds must be at least 1 and --streams at least 2 (got {a.rounds}, {a.streams})")
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()
    meshes: dict[str, Mesh] = {}
    with tempfile.TemporaryDirectory() as logs:
        try:
            for name, (pp, flags) in MESHES.items():
                log_dir = Path(logs) / name.replace(" ", "-").replace("=", "")
                log_dir.mkdir()
                meshes[name] = Mesh(model_dir, pp, 1, "auto", a.streams, log_dir, 2, "none",
                                    extra=("--dtype", a.dtype, *flags))  # fmt: skip
            links = {name: m.links() for name, m in meshes.items()}
            priority = {name: m.priorities() for name, m in meshes.items()}
            for m in meshes.values():  # warm-up
                run_streams(m.address, prompt_ids, 8, 1)
            rounds = []
            names = list(MESHES)
            for i in range(a.rounds):
                order = names[i % len(names) :] + names[: i % len(names)]
                rounds.append({name: measure(meshes[name], prompt_ids, a) for name in order})
                print(f"round {i + 1}: {rounds[-1]}", flush=True)
        finally:
            for m in meshes.values():
                m.close()
    found = derived(rounds)
    data = {"args": vars(a), "links": links, "compute_priority": priority, "rounds": rounds, "derived": found}
    # The dtype in the name: a bfloat16 run after a float32 one the same day wrote over it.
    save_results(Path(a.out), info, f"-pipeline-seams-{a.dtype}", markdown(info, a, rounds, found, links, priority),
                 data)  # fmt: skip


if __name__ == "__main__":
    main()
