"""A decode step over the paged KV cache against the slot cache: SmolLM2, 16 sequences of ~500 tokens.

    .venv/bin/python bench/paged_attention.py [--model smollm2-135m-instruct] [--sequences 16] [--context 500]
                                              [--block-size 16] [--steps 30] [--rounds 5] [--threads 1,2]

Writes bench/results/<host>-<date>-paged-attention.{md,json} and prints the markdown. The issue's bar: "a decode
step at 16 sequences no slower than the slot cache beyond noise". One process, one run, at each of `--threads`
(torch's intra-op threads; on a shared machine SDPA's two-thread split can collapse, so both are recorded):

- One shard holding the whole model (pp=1, tp=1, float32), two caches: a slot cache (`KVCache`, sequence i in
  slot i) and a paged one (`PagedKVCache`, blocks of `--block-size`, each sequence's block table drawn from a
  shuffled pool: blocks scattered as after a while of serving). Both hold the same keys and values: random ones
  written into both (attention's speed does not depend on the numbers; a real prefill of 16 x 500 tokens would
  only cost minutes), at lengths drawn in [0.95, 1.05] x `--context` so the sequences differ as in serving.
- Whole step: `StageEngine.step` of one new token per sequence (the layout built inside the timed call, since the
  paged one carries block tables), each call at the same positions.
- Attention alone: for each of the model's layers, the cache's `write` of 16 new keys and values and its
  `attend_decode` (slot: one SDPA call over the slot range, masked; paged: the `paged-cpu` kernel; and for
  reference `paged-gather`, the torch fallback that copies the blocks).
- The variants run interleaved, one call each in turn (`timing._median_ms`), so drift on a shared machine hits
  all alike; per round the median of `--steps` calls; every number is the median of the rounds' medians, and the
  ratio is paged over slot (< 1: paged faster), with its range over the rounds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402  (the repository root is on the path only now)


class Setup:
    """The model, both caches filled alike, the sequences' lengths and block tables."""

    def __init__(self, model_dir: Path, n: int, context: int, block_size: int, seed: int = 0) -> None:
        import torch

        from shardmesh.core.config import ModelConfig
        from shardmesh.core.layout import ShardSpec
        from shardmesh.engine.groups import ShardGroups, SingleRank
        from shardmesh.engine.loader import build_shard
        from shardmesh.engine.stage import StageEngine

        rng = random.Random(seed)
        self.lengths = [rng.randint(int(context * 0.95), int(context * 1.05)) for _ in range(n)]
        max_len = -(-(max(self.lengths) + 1) // block_size) * block_size
        cfg = ModelConfig.from_dir(model_dir)
        spec = ShardSpec(0, cfg.num_layers, cfg.num_layers)
        self.model = build_shard(model_dir, spec, SingleRank(), dtype=torch.float32, max_len=max_len, progress=False)
        per_seq = max_len // block_size
        pool = list(range(n * per_seq))
        rng.shuffle(pool)
        self.tables = [tuple(pool[i * per_seq : (i + 1) * per_seq]) for i in range(n)]
        device = torch.device("cpu")
        self.slot = self.model.make_cache(n, torch.float32, device)
        self.paged = self.model.make_paged_cache(len(pool), block_size, torch.float32, device)
        self._fill(block_size, torch.Generator().manual_seed(seed))
        groups = ShardGroups(spec, 0, 1, SingleRank(), None, None)
        self.engines = {"slot": StageEngine(self.model, groups, self.slot, device),
                        "paged": StageEngine(self.model, groups, self.paged, device)}  # fmt: skip
        self.block_size = block_size

    def _fill(self, block_size: int, g: Any) -> None:
        """The same random keys and values at every sequence's positions, in its slot and in its blocks (each
        cache's own `write`, as a prefill would)."""
        import torch

        from shardmesh.core.step import Segment
        from shardmesh.engine.batch import BatchLayout

        kvh, hd = self.slot.data.shape[3], self.slot.data.shape[5]
        for i, (n, table) in enumerate(zip(self.lengths, self.tables, strict=True)):
            slot = BatchLayout.build([Segment(i, 0, n)])
            paged = BatchLayout.build([Segment(i, 0, n, table)], block_size=block_size)
            for layer in range(self.slot.data.shape[0]):
                k, v = torch.randn((2, n, kvh, hd), generator=g)
                self.slot.write(layer, slot, k, v)
                self.paged.write(layer, paged, k, v)

    def segments(self, paged: bool) -> list[Any]:
        from shardmesh.core.step import Segment

        return [Segment(i, n, 1, self.tables[i] if paged else ()) for i, n in enumerate(self.lengths)]


def step_fns(s: Setup) -> dict[str, Any]:
    """A whole decode step on each cache: layout, embedding, 30 layers, head."""
    import torch

    from shardmesh.engine.batch import BatchLayout

    ids = torch.randint(3, s.model.cfg.vocab_size, (len(s.lengths),))

    def slot() -> None:
        s.engines["slot"].step(BatchLayout.build(s.segments(False)), ids)

    def paged() -> None:
        s.engines["paged"].step(BatchLayout.build(s.segments(True), block_size=s.block_size), ids)

    return {"slot": slot, "paged": paged}


def attention_fns(s: Setup) -> dict[str, Any]:
    """Each layer's write of the new keys and values and its decode read, on each cache (and the gather)."""
    import torch

    from shardmesh.engine.batch import BatchLayout
    from shardmesh.engine.paged_attention import GatherDecode

    cfg, n = s.model.cfg, len(s.lengths)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(n, cfg.num_heads, cfg.head_dim, generator=g)
    k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=g)
    slot_batch = BatchLayout.build(s.segments(False))
    paged_batch = BatchLayout.build(s.segments(True), block_size=s.block_size)
    layers = range(len(s.model.model.layers))
    gather = GatherDecode()

    def run(cache: Any, batch: Any) -> None:
        for layer in layers:
            cache.write(layer, batch, k, k)
            cache.attend_decode(layer, q, batch.decode)

    def run_gather() -> None:  # the same blocks, read by the torch fallback
        d = paged_batch.decode
        for layer in layers:
            s.paged.write(layer, paged_batch, k, k)
            gather(q, s.paged.keys(layer), s.paged.values(layer), d.tables, d.lengths)

    assert slot_batch.decode is not None and paged_batch.decode is not None
    return {"slot": lambda: run(s.slot, slot_batch), "paged": lambda: run(s.paged, paged_batch),
            "paged-gather": run_gather}  # fmt: skip


def measure(fns: dict[str, Any], steps: int, rounds: int) -> dict[str, Any]:
    """Per variant: the median over rounds of each round's median ms, and each round's ratio to "slot"."""
    import torch

    from shardmesh.engine.timing import _median_ms

    per_round = [dict(zip(fns, _median_ms(tuple(fns.values()), steps, torch.device("cpu")), strict=True))
                 for _ in range(rounds)]  # fmt: skip
    out = {}
    for name in fns:
        ratios = [r[name] / r["slot"] for r in per_round]
        out[name] = {"ms": statistics.median(r[name] for r in per_round), "ratio": statistics.median(ratios),
                     "ratio_range": [min(ratios), max(ratios)], "rounds_ms": [r[name] for r in per_round]}  # fmt: skip
    return out


def markdown(info: dict, a: argparse.Namespace, s: Setup, results: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"## Paged KV cache against the slot cache, one decode step — {info['cpu']}, {info['cores']} cores, "
        f"torch {info['torch']}, {info['date']}",
        "",
        f"Model `{a.model}` float32, one shard (pp=1, tp=1), {len(s.lengths)} sequences of "
        f"{min(s.lengths)}–{max(s.lengths)} tokens (median {statistics.median(s.lengths):g}) decoding together; "
        f"blocks of {a.block_size} tokens from a shuffled pool of {s.paged.num_blocks}; paged decode kernel "
        f"`{s.paged.attention_kernel}`. Median ms per call over {a.steps} calls × {a.rounds} rounds (median of the "
        f"rounds' medians), the variants interleaved call by call. CPU flags: {' '.join(info['cpu_flags'])}. The "
        f"machine was shared (other engineers' tests may have been running): compare the ratios, measured side by "
        f"side, not the absolute times.",
        "",
        "| threads | measured | variant | ms | × slot (paged / slot) | range over rounds |",
        "|---:|---|---|---:|---:|---|",
    ]
    for (threads, what), res in results.items():
        for name, r in res.items():
            lo, hi = r["ratio_range"]
            lines.append(f"| {threads} | {what} | {name} | {r['ms']:.2f} | **{r['ratio']:.2f}×** | {lo:.2f}–{hi:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, each measured in turn")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    a = p.parse_args()

    import torch

    model_dir = Path.home() / ".cache" / "shardmesh" / "models" / a.model
    s = Setup(model_dir, a.sequences, a.context, a.block_size)
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        results[threads, "attention alone (all layers)"] = measure(attention_fns(s), a.steps, a.rounds)
        results[threads, "whole decode step"] = measure(step_fns(s), a.steps, a.rounds)
    info = machine()  # the CPU's flags that pick kernels included
    data = {"args": {k: str(v) for k, v in vars(a).items()}, "lengths": s.lengths, "kernel": s.paged.attention_kernel,
            "results": [{"threads": t, "measured": what, **res} for (t, what), res in results.items()]}  # fmt: skip
    save_results(a.out, info, "-paged-attention", markdown(info, a, s, results), data)


if __name__ == "__main__":
    main()
