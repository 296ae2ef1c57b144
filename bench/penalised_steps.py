"""What a penalty costs a decode call, and what drawing a penalised call's steps inside one compiled call saves
(`--ask alternatives`: the same for calls asking for 5 top log-probabilities a token).

    .venv/bin/python bench/penalised_steps.py [--model smollm2-135m-instruct] [--dtype float32] [--rows 1,16]
                                              [--cycles 30] [--prompt-tokens 300] [--ask penalties|alternatives]
                                              [--out bench/results]

One process holds one `StageWorkerCore` with the whole model (pp=1, as a worker holds it) and runs calls of 8 decode
steps (the gateway's default `--decode-steps`) of `--rows` sequences, sampled at temperature 0.7 and top-p 0.9,
seeded, three ways alternated within every cycle (the order rotating from cycle to cycle), each on sequences of its
own:
- `no penalty`: the call's later steps and their draws in one compiled call (`StageEngine.drawn_steps`);
- `penalised, one call`: the same with frequency 0.5, presence 0.3 and repetition 1.1 penalties, counted in that call
  (`cpu_kernels`' StepPenalties);
- `penalised, per step`: the same penalties, with the one call refused (`StageWorkerCore._drawn_steps` answering
  None), so that every later step returns to Python for its forward, the token history's record and
  `sampling.sample`: what every penalised call did before.
With `--ask alternatives` the second and third ways ask for 5 top log-probabilities a token instead of penalties
(`no alternatives`, `alternatives, one call`, `alternatives, per step`; `cpu_kernels`' StepTops).
Each sequence starts from a prompt of `--prompt-tokens` random ids (what the penalties count), the same for every way.
A number is one call's wall time per token; each ratio is taken within a cycle, against `no penalty`, and reported as
the median over cycles with its quartiles, so this host's drift (its memory speed moves by 20% within minutes) falls
on the ways alike. Writes <out>/<host>-<date>-penalised-steps-<dtype>.{md,json} (`-alternatives-steps-` with
`--ask alternatives`) and prints the markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402

STEPS = 8
PENALTIES = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}
WAYS = ("no penalty", "penalised, one call", "penalised, per step")
ALTERNATIVES = 5  # top log-probabilities a token, with --ask alternatives


class Ask(NamedTuple):
    """What the shaped calls ask for (`--ask`)."""

    ways: tuple[str, str, str]  # plain, shaped in one call, shaped step by step
    words: str  # what they ask, for the report
    fields: dict[str, Any]  # the sampling fields it adds
    title: str  # the report's
    stem: str  # the results' file name's: <host>-<date>-<stem>-steps-<dtype>


ASKS = {
    "penalties": Ask(WAYS, "penalties: frequency 0.5, presence 0.3, repetition 1.1", PENALTIES,
                     "Penalised decode calls", "penalised"),
    "alternatives": Ask(("no alternatives", "alternatives, one call", "alternatives, per step"),
                        f"{ALTERNATIVES} top log-probabilities a token", {"top_logprobs": ALTERNATIVES},
                        "Decode calls asking for alternatives", "alternatives"),
}  # fmt: skip


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def report(info: dict, a: argparse.Namespace, got: dict[int, dict[str, list[float]]]) -> tuple[str, dict]:
    """The markdown and the rows: each way's median ms per token, and its ratio to the first way's (`no penalty`)
    and to the third's (`penalised, per step`) per cycle."""
    ask = ASKS[a.ask]
    names = ask.ways
    rows: dict[str, Any] = {}
    lines = [
        f"## {ask.title} — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}",
        "",
        f"SmolLM2 {a.dtype}, one stage core (pp=1), calls of {STEPS} decode steps, temperature 0.7, top-p 0.9, seeded; "
        f"{ask.words}; a prompt of {a.prompt_tokens} tokens; {a.cycles} cycles, the three ways alternated within each. "
        f"Ratio: the way's ms per token over `{names[0]}`'s in the same cycle, the median over cycles [quartiles]; "
        "below 1 is faster.",
        "",
        f"| rows | way | ms per token | ÷ {names[0]} [quartiles] | ÷ {names[2]} [quartiles] |",
        "|---:|---|---:|---:|---:|",
    ]
    for n, ways in got.items():
        for way in names:
            base = [w / b for w, b in zip(ways[way], ways[names[0]], strict=True)]
            old = [w / b for w, b in zip(ways[way], ways[names[2]], strict=True)]
            q, r = quartiles(base), quartiles(old)
            rows[f"{n}/{way}"] = {"ms_per_token": statistics.median(ways[way]), "over_no_penalty": q,
                                  "over_per_step": r}  # fmt: skip
            lines.append(f"| {n} | {way} | {statistics.median(ways[way]):.2f} | {q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}] | "
                         f"{r[1]:.3f} [{r[0]:.3f}, {r[2]:.3f}] |")  # fmt: skip
    return "\n".join(lines) + "\n", rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ask", choices=list(ASKS), default="penalties", help="what the shaped calls ask for")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    names, shape = ASKS[a.ask].ways, ASKS[a.ask].fields
    if a.cycles < 4 or min(a.rows) < 1 or a.prompt_tokens < 1:
        ap.error(f"--cycles at least 4, --rows and --prompt-tokens positive: got {a.cycles}, {a.rows}, "
                 f"{a.prompt_tokens}")  # fmt: skip

    import structlog
    import torch
    import torch.distributed as dist

    from shardmesh.core import topology as t
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.step import SamplingParams, StepEntry
    from shardmesh.models.registry import resolve
    from shardworker import runtime
    from shardworker.runtime import StageWorkerCore

    torch.set_num_threads(a.threads)
    model_dir = resolve(a.model)
    cfg = ModelConfig.from_dir(model_dir)
    context = a.prompt_tokens + (a.cycles + 2) * STEPS
    if context > cfg.max_position_embeddings:
        ap.error(f"a sequence would reach position {context}, past the model's {cfg.max_position_embeddings}")
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    # Refusing the one call for the sequences of `penalised, per step` only: the others take it as a worker would.
    original = StageWorkerCore._drawn_steps

    def drawn_steps(self: StageWorkerCore, rt: Any, entries: list, *args: Any) -> Any:
        if entries[0].request_id.startswith("per step"):
            return None
        return original(self, rt, entries, *args)

    runtime.StageWorkerCore._drawn_steps = drawn_steps  # type: ignore[method-assign]
    store = dist.TCPStore("127.0.0.1", 0, None, True)
    info = machine()
    got: dict[int, dict[str, list[float]]] = {}
    for n in a.rows:
        slots = n * len(WAYS)
        spec = t.ModelSpec(str(model_dir), a.dtype, "LlamaForCausalLM", cfg.num_layers, cfg.hidden_size,
                           cfg.vocab_size, context)  # fmt: skip
        placed = (t.Stage(0, 0, cfg.num_layers, (t.ShardAssignment(0, 0, "w0", "", t.ShardState.READY),)),)
        version = n
        topology = t.Topology(version, spec, 1, 1, placed, t.Rendezvous.for_epoch("127.0.0.1", store.port, n, 1),
                              True, t.ServingLimits(slots, context, max(64, n * a.prompt_tokens)))  # fmt: skip
        core = StageWorkerCore("w0", torch.device("cpu"), structlog.wrap_logger(structlog.ReturnLogger()), 120.0)
        core.apply(topology)
        plain = SamplingParams(temperature=0.7, top_p=0.9, seed=7, prompt_len=a.prompt_tokens)
        shaped = replace(plain, **shape)
        params = dict(zip(names, (plain, shaped, shaped), strict=True))
        ids = {way: [f"{'per step' if 'per step' in way else way} {i}" for i in range(n)] for way in names}
        slot_of = {way: [w * n + i for i in range(n)] for w, way in enumerate(names)}
        tokens: dict[str, list[int]] = {}
        for way in names:
            first = core.step(version, [StepEntry(r, s, 0, len(prompt), tuple(prompt), params[way])
                                        for r, s in zip(ids[way], slot_of[way], strict=True)])  # fmt: skip
            tokens[way] = [x.token_id for x in first.sampled]
        pos = {way: len(prompt) for way in names}
        times: dict[str, list[float]] = {way: [] for way in names}
        for c in range(a.cycles + 1):  # cycle 0 warms up
            for way in names[c % 3 :] + names[: c % 3]:
                entries = [StepEntry(r, s, pos[way], 1, (tok,), params[way])
                           for r, s, tok in zip(ids[way], slot_of[way], tokens[way], strict=True)]  # fmt: skip
                t0 = time.perf_counter()
                result = core.step(version, entries, STEPS)
                if c:
                    times[way].append((time.perf_counter() - t0) * 1e3 / STEPS)
                tokens[way] = [x.token_id for x in result.sampled[-n:]]
                pos[way] += STEPS
        got[n] = times
        print(f"rows {n}: " + ", ".join(f"{w} {statistics.median(v):.2f} ms" for w, v in times.items()),
              file=sys.stderr)  # fmt: skip
        core.close()
    md, rows = report(info, a, got)
    print(md)
    save_results(Path(a.out), info, f"-{ASKS[a.ask].stem}-steps-{a.dtype}", md,
                 {"dtype": a.dtype, "prompt_tokens": a.prompt_tokens, "ask": a.ask, "rows": rows,
                  "times": got})  # fmt: skip


if __name__ == "__main__":
    main()
