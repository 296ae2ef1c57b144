"""Decode speed of int8 weight-only against float32, one stream and 16: shardmesh's two, and llama.cpp's Q8_0.

    .venv/bin/python bench/int8.py [--model smollm2-135m-instruct] [--threads 2] [--steps 64] [--rounds 3]
                                   [--streams 1,16] [--no-llamacpp]

Writes bench/results/<host>-<date>-int8.{md,json} and prints the markdown. What it measures, all in one process
and one run, on `--threads` cores:

- shardmesh float32 and shardmesh int8 with the kernel chosen at load (float32 activations: `int8-blocked` on
  AVX-512, `int8-cpu` elsewhere where it builds) (`build_shard(..., quantization=Quantization.INT8)`: the decoder
  layers' products and the LM head as int8 with a float16 scale and minimum per 32 inputs of a row, the embedding
  in float32), one shard holding
  the whole model (pp=1, tp=1), driven like `shardmesh generate` drives its stage (shardmesh_cli/offline.py):
  `StageEngine.step` on a `BatchLayout` of one segment per sequence, over a KV cache. The chat prompt of
  bench/conditions.py is prefilled into every sequence, then each timed call is one greedy decode step of all
  of them (`StageEngine.step` and an argmax over the logits). The two models step alternately, one step each
  (`shardmesh.engine.timing._median_ms`, the interleaving of the shard calibration), so drift on a shared
  machine hits both alike; the first step is warm-up. Per round: the median ms per step of `--steps` steps,
  at 1 sequence and at 16 sequences decoding together.
- llama.cpp (llama-cpp-python, when it is installed: `pip install '.[bench]'`) on a Q8_0 GGUF of the same
  weights, written here from the weights the mesh serves (every 2-D tensor Q8_0, the 1-D norms F32: what
  llama.cpp's own Q8_0 conversion gives, the token embedding, which is also the tied LM head, included), and
  for reference on the F32 GGUF of bench/llamacpp.py. One stream: `llamacpp.measure` (median ms per token of a
  greedy decode of `--steps` tokens after a warm-up run). 16 streams: llama.cpp's own batched decoding
  (one `llama_decode` of a batch of 16 tokens, one per sequence, through the low-level API) with the same
  prompt prefilled in each sequence; the median ms per step over `--steps` steps after a warm-up step.
- `--rounds` rounds of all of the above, one after the other, each with a fresh KV cache; every number is the
  median of the rounds' medians, and each ratio is float32 shardmesh's ms per step over the variant's (>1:
  faster than shardmesh float32), as measured in this run.

Also recorded: each shardmesh variant's bytes of weights (every parameter and buffer of the shard), the GGUF
files' sizes, the linear kernels `build_shard` chose (`model.linear_kernels`), the CPU's model and its flags
that decide those kernels (`bench.conditions`), and how many of the
one-stream greedy tokens int8 shares with float32 before they first differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llamacpp  # noqa: E402  (the repository root is on the path only now)
from bench.conditions import PROMPT, machine, save_results  # noqa: E402

Q8_0_GGUF_NAME = "model-q8_0.gguf"


# --------------------------------------------------------------------------------------------------
# shardmesh, in process
# --------------------------------------------------------------------------------------------------


class Streams:
    """`n` sequences of one shard that holds the whole model, decoding greedily in lock step, as
    shardmesh_cli/offline.py's `_decode` drives its stage (slots 0..n-1 of the KV cache)."""

    def __init__(self, model: Any, n: int, prompt_ids: Sequence[int]) -> None:
        import torch

        from shardmesh.core.layout import ShardSpec
        from shardmesh.core.step import Segment
        from shardmesh.engine.batch import BatchLayout
        from shardmesh.engine.groups import ShardGroups, SingleRank
        from shardmesh.engine.stage import StageEngine

        device = torch.device("cpu")
        cfg = model.cfg
        groups = ShardGroups(ShardSpec(0, cfg.num_layers, cfg.num_layers), 0, 1, SingleRank(), None, None)
        self.engine = StageEngine(model, groups, model.make_cache(n, model.dtype, device), device)
        self.n, self.tokens, self.first = n, [], []
        prefill = BatchLayout.build([Segment(slot, 0, len(prompt_ids)) for slot in range(n)], device)
        self.next = self.engine.step(prefill, torch.tensor(list(prompt_ids) * n)).argmax(-1)
        self.pos = len(prompt_ids)

    def step(self) -> None:
        """One decode step of every sequence: feed the tokens chosen last step, choose the next ones."""
        from shardmesh.core.step import Segment
        from shardmesh.engine.batch import BatchLayout

        batch = BatchLayout.build([Segment(slot, self.pos, 1) for slot in range(self.n)], self.engine.device)
        self.first.append(int(self.next[0]))
        self.next = self.engine.step(batch, self.next).argmax(-1)
        self.pos += 1


def weight_bytes(model: Any) -> int:
    """Bytes of the shard's tensors: every parameter and buffer (int8 values, their scales, the RoPE tables)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def load_shardmesh(model_dir: Path, max_len: int) -> dict[str, Any]:
    """{"float32": model, "int8": model}, each one shard of the whole model, int8 with the kernel `build_shard`
    chooses (float32 activations)."""
    import torch

    from shardmesh.core.config import ModelConfig
    from shardmesh.core.dtypes import Quantization
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.groups import SingleRank
    from shardmesh.engine.loader import build_shard

    cfg = ModelConfig.from_dir(model_dir)
    spec = ShardSpec(0, cfg.num_layers, cfg.num_layers)
    kw = {"dtype": torch.float32, "max_len": max_len, "progress": False, "cfg": cfg}
    return {
        name: build_shard(model_dir, spec, SingleRank(), quantization=q, **kw)
        for name, q in (("float32", Quantization.NONE), ("int8", Quantization.INT8))
    }


def time_shardmesh(models: dict[str, Any], prompt_ids: Sequence[int], n: int, steps: int) -> dict[str, Any]:
    """Median ms per decode step of each model at `n` sequences, the models' steps interleaved one by one;
    and the first sequence's greedy tokens."""
    from shardmesh.engine.timing import _median_ms

    streams = {name: Streams(model, n, prompt_ids) for name, model in models.items()}
    ms = _median_ms(tuple(s.step for s in streams.values()), steps, streams["float32"].engine.device)
    return {"ms": dict(zip(streams, ms, strict=True)), "tokens": {name: s.first for name, s in streams.items()}}


# --------------------------------------------------------------------------------------------------
# llama.cpp: the Q8_0 GGUF and batched decoding
# --------------------------------------------------------------------------------------------------


def write_q8_0_gguf(source: Path, out_path: Path) -> None:
    """``source`` (any GGUF gguf-py can dequantize) at ``out_path`` as llama.cpp's Q8_0 file type: every 2-D
    tensor quantized to Q8_0 from its float32 values (the very values bench/llamacpp.py's F32 GGUF holds and
    the mesh serves), the 1-D ones (norms) float32, ``general.file_type`` MOSTLY_Q8_0 (`llamacpp.write_gguf`)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    llamacpp.write_gguf(source, out_path, GGMLQuantizationType.Q8_0, int(LlamaFileType.MOSTLY_Q8_0))


def q8_0_gguf(model: str) -> Path:
    """The Q8_0 GGUF of ``model``, cached next to the F32 one (written once, under a temporary name)."""
    import os

    from shardmesh.models.cache import locate_gguf
    from shardmesh.models.registry import get_source

    out_path = llamacpp.default_f32_path(model).with_name(Q8_0_GGUF_NAME)
    if out_path.is_file():
        return out_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        write_q8_0_gguf(locate_gguf(get_source(model)), tmp)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def llama_batched(gguf_path: Path, prompt_ids: Sequence[int], n: int, steps: int, threads: int) -> dict[str, Any]:
    """llama.cpp decoding `n` sequences together, through its low-level API (the high-level `Llama` makes a
    context of one sequence): the prompt prefilled into each sequence (one `llama_decode` each), then per step
    one `llama_decode` of a batch of `n` tokens, one per sequence, and a greedy argmax of each sequence's
    logits. Each sequence has its own KV cells (`kv_unified` off, llama-server's default). Median ms per step
    over `steps` steps, after one warm-up step."""
    import llama_cpp as lc

    lc.llama_backend_init()
    per_seq = -(-(len(prompt_ids) + steps + 2) // 256) * 256  # llama.cpp pads each sequence's cells to 256
    model = lc.llama_model_load_from_file(str(gguf_path).encode(), lc.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.kv_unified = n * per_seq, n, False
    params.n_batch = params.n_ubatch = max(512, len(prompt_ids), n)
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not make a context")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(max(n, len(prompt_ids)), 0, 1)

    def decode(rows: Sequence[tuple[int, int, int]], logits_all: bool) -> None:
        """(token, position, sequence) rows: logits for every row, or for the last only (a prefill)."""
        batch.n_tokens = len(rows)
        for i, (token, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos, 1, seq
            batch.logits[i] = logits_all or i == len(rows) - 1
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(vocab,)).argmax())

    try:
        nxt = []
        for seq in range(n):
            decode([(t, p, seq) for p, t in enumerate(prompt_ids)], logits_all=False)
            nxt.append(argmax(len(prompt_ids) - 1))
        times, first = [], []  # first: the first sequence's tokens
        for step in range(steps + 1):
            pos = len(prompt_ids) + step
            first.append(nxt[0])
            t0 = time.perf_counter()
            decode([(nxt[seq], pos, seq) for seq in range(n)], logits_all=True)
            nxt = [argmax(row) for row in range(n)]
            if step:  # the first step warms up
                times.append((time.perf_counter() - t0) * 1e3)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {"ms": statistics.median(times), "streams": n, "tokens": first}


def llama_variants(model: str) -> dict[str, Path]:
    return {"llama.cpp Q8_0": q8_0_gguf(model), "llama.cpp F32": llamacpp.f32_gguf(model=model)}


def time_llama(ggufs: dict[str, Path], prompt_ids: Sequence[int], n: int, steps: int, threads: int) -> dict:
    """{variant: median ms per step} at `n` streams (or {"skipped": why}: llama.cpp's errors do not stop the
    shardmesh numbers)."""
    out: dict[str, Any] = {}
    for name, path in ggufs.items():
        try:
            if n == 1:
                out[name] = llamacpp.measure(path, prompt_ids, steps + 1, threads)["ms_per_token_median"]
            else:
                out[name] = llama_batched(path, prompt_ids, n, steps, threads)["ms"]
        except Exception as exc:  # a broken llama-cpp-python build, or one without some API: say so
            out[name] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def summarize(rounds: list[dict[int, dict[str, Any]]], streams: list[int]) -> dict[int, dict[str, dict]]:
    """{streams: {variant: {"ms", "ratio", "ratio_range", "rounds_ms"}}}: medians over the rounds; the ratio is
    shardmesh float32's ms over the variant's (from the medians), its range over the rounds' own ratios."""
    out: dict[int, dict[str, dict]] = {}
    for n in streams:
        per_variant: dict[str, list[float]] = {}
        paired: dict[str, list[float]] = {}
        for r in rounds:
            for name, ms in r[n].items():
                if isinstance(ms, float):
                    per_variant.setdefault(name, []).append(ms)
                    paired.setdefault(name, []).append(r[n]["shardmesh float32"] / ms)
        base = per_variant["shardmesh float32"]
        out[n] = {}
        for name, values in per_variant.items():
            ratio = statistics.median(base) / statistics.median(values)
            span = [min(paired[name]), max(paired[name])]
            out[n][name] = {"ms": statistics.median(values), "ratio": ratio, "ratio_range": span, "rounds_ms": values}
    return out


def report(info: dict, a: argparse.Namespace, summary: dict, extra: dict, out: Path) -> None:
    sizes = extra["weight_bytes"]
    lines = [
        f"## int8 weight-only decode — {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {info['date']}",
        "",
        f"Model `{a.model}`, greedy, chat prompt of {PROMPT!r} ({extra['prompt_tokens']} tokens) prefilled in every "
        f"stream; {a.threads} threads; median ms per decode step over {a.steps} steps × {a.rounds} rounds (median of "
        f"the rounds' medians). CPU flags: {' '.join(info['cpu_flags']) or 'none of interest'}. The machine was shared "
        "(another engineer's tests may have been running): compare ratios, measured side by side, not absolute "
        "times.",
        "",
        f"shardmesh kernels: float32 `{', '.join(extra['kernels']['float32'])}`; int8 "
        f"`{', '.join(extra['kernels']['int8'])}` (the LM head in int8 too, the embedding float32). Weight bytes: "
        "float32 "
        f"{sizes['float32'] / 2**20:.1f} MiB, int8 {sizes['int8'] / 2**20:.1f} MiB "
        f"({sizes['int8'] / sizes['float32']:.2f}×).",
    ]
    if extra.get("gguf_bytes"):
        files = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in extra["gguf_bytes"].items())
        lines.append(f"GGUF files: {files} (Q8_0 quantizes the token embedding, which is also the tied LM head; "
                     "shardmesh int8 quantizes the head and keeps the embedding float32 for lookups).")  # fmt: skip
    lines += [
        f"Greedy tokens, one stream: int8 agrees with float32 on the first {extra['agree']} of {a.steps + 1}.",
        "",
        "| streams | variant | ms / step | tok/s (all streams) | × shardmesh float32 | range over rounds |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for n, rows in summary.items():
        for name, r in rows.items():
            lo, hi = r["ratio_range"]
            bold = "**" if name != "shardmesh float32" else ""
            lines.append(f"| {n} | {name} | {r['ms']:.2f} | {n * 1e3 / r['ms']:.1f} | {bold}{r['ratio']:.2f}×{bold} "
                         f"| {lo:.2f}–{hi:.2f} |")  # fmt: skip
    for n, why in extra["llama_skipped"].items():
        lines += ["", f"llama.cpp, {n} stream(s): not measured ({why})."]
    md = "\n".join(lines) + "\n"
    save_results(out, info, "-int8", md, {"args": vars(a), "summary": summary, **extra})


def main() -> None:
    import os

    import torch

    from shardmesh.models.registry import known_models, resolve
    from shardmesh.models.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", choices=known_models())
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per variant, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--no-llamacpp", action="store_true", help="shardmesh only")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    streams = [int(s) for s in a.streams.split(",")]
    if 1 not in streams:
        streams.insert(0, 1)  # the token agreement is read from the one-stream run

    torch.set_num_threads(a.threads)
    model_dir = resolve(a.model)
    prompt_ids = Tokenizer.from_dir(model_dir).encode_chat([{"role": "user", "content": PROMPT}])
    info = machine()  # CPU model and flags included
    print(f"machine: {info}", file=sys.stderr)
    models = load_shardmesh(model_dir, max_len=len(prompt_ids) + a.steps + 2)
    extra: dict[str, Any] = {
        "prompt_tokens": len(prompt_ids),
        "kernels": {name: m.linear_kernels for name, m in models.items()},
        "weight_bytes": {name: weight_bytes(m) for name, m in models.items()},
        "llama_skipped": {},
    }
    print(f"kernels {extra['kernels']}, weight bytes {extra['weight_bytes']}", file=sys.stderr)
    reason = "--no-llamacpp" if a.no_llamacpp else llamacpp.available()
    ggufs: dict[str, Path] = {}
    if reason is None:
        try:
            ggufs = llama_variants(a.model)
        except Exception as exc:
            reason = f"writing the GGUF files failed: {type(exc).__name__}: {exc}"
    if reason is not None:
        extra["llama_skipped"] = dict.fromkeys(streams, reason)
    else:
        import llama_cpp

        extra["llama_cpp"] = llama_cpp.__version__
        extra["gguf_bytes"] = {name: p.stat().st_size for name, p in ggufs.items()}
        extra["gguf"] = {name: str(p) for name, p in ggufs.items()}

    rounds: list[dict[int, dict[str, Any]]] = []
    tokens: dict[str, list[int]] = {}
    for i in range(a.rounds):
        this: dict[int, dict[str, Any]] = {}
        for n in streams:
            sm = time_shardmesh(models, prompt_ids, n, a.steps)
            this[n] = {f"shardmesh {k}": v for k, v in sm["ms"].items()}
            if n == 1:
                tokens = sm["tokens"]
            if ggufs:
                lm = time_llama(ggufs, prompt_ids, n, a.steps, a.threads)
                for name, v in lm.items():
                    if isinstance(v, dict):
                        extra["llama_skipped"][n] = f"{name}: {v['skipped']}"
                this[n].update(lm)
            print(f"round {i + 1}, {n} stream(s): {this[n]}", file=sys.stderr)
        rounds.append(this)
    extra["agree"] = first_difference(tokens["float32"], tokens["int8"])
    extra["tokens"] = tokens
    extra["rounds"] = rounds
    report(info, a, summarize(rounds, streams), extra, Path(a.out))


if __name__ == "__main__":
    main()
