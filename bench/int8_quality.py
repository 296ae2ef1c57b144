"""How close int8 weights come to float32 on SmolLM2, which products carry the error, and what the candidate
fixes and llama.cpp's Q8_0 give, on the issue's gates.

    .venv/bin/python bench/int8_quality.py [--model smollm2-135m-instruct] [--steps sensitivity,variants,llamacpp]

Writes bench/results/<host>-<date>-int8-quality.{md,json} and prints the markdown. The gates (issue "Serve models
beyond the memory at hand"): over `gate_ids` (2,048 next tokens of Python's documentation topics, teacher-forced
in one prefill), int8 against float32, mean |Δ logprob| at most 0.03 nats and perplexity ratio at most 1.02; greedy
64-token answers to `CHAT_PROMPTS` identical on at least 8 of 10. tests/equivalence/test_smollm2.py imports the
text, the prompts and the two measurements from here, so the test and the study measure the same thing.

Step `served`: the gates for `--quantize int8` as served (int8 groups of 32 with a float16 scale and minimum each,
`shardmesh.engine.linear.quantize_groups`; the kernels chosen at load) against float32.

The other steps study the first format, one scale per output row, and its candidate fixes, each on one float32
shard of the whole model whose products use `F.linear` on plain (out, in)
weights (`SHARDMESH_LINEAR_KERNEL=dense`), so a product's weight can be swapped for its int8 round trip
(`fake_int8`: the first int8 format, one scale per output row, rounded and back to float):

- sensitivity: one product of one layer in int8 at a time, everything else float32; its mean |Δ logprob|.
  The hidden states entering each layer are kept from the float32 pass, so a product of layer L re-runs layers
  L..29 only.
- variants: every product in int8, plain and with the candidate fixes: the most sensitive products kept in
  float32 (their bytes printed); activation-aware per-input-channel scales (AWQ-style, `smoothing_scales`,
  searched on `calibration_ids`, a different passage of the same topics, and foldable into the previous norm
  or product); GPTQ rounding (`gptq`, needs each product's input Hessian from the calibration text).
- llamacpp: llama.cpp's Q8_0 GGUF (a scale per 32 weights, the embedding / tied LM head in Q8_0 too) against
  its F32 GGUF of the same weights (bench/llamacpp.py, bench/int8.py write both), on the same ids.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.conditions import machine, save_results  # noqa: E402

GATE_TOKENS = 2048  # next tokens scored; the text is one more
GREEDY_TOKENS = 64
EOS = 2  # SmolLM2's <|im_end|>: an answer ends there
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about a lighthouse keeper.",
    "Explain how a rainbow forms.",
    "Give me three tips for sleeping better.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle in simple terms.",
    "How do I make a cup of green tea?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?",
    "Suggest a name for a friendly robot and explain why.",
)
KINDS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _topics(start: int, stop: int) -> str:
    """Python's documentation topics (shipped with every Python), sorted by name, characters [start, stop)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n".join(topics[k] for k in sorted(topics))[start:stop]


def gate_ids(tokenizer: Any) -> list[int]:
    """The gate's text: the first `GATE_TOKENS` + 1 tokens of the topics (well inside their first 40,000 chars)."""
    ids = tokenizer.encode(_topics(0, 40000), add_special_tokens=False)[: GATE_TOKENS + 1]
    assert len(ids) == GATE_TOKENS + 1
    return ids


def calibration_ids(tokenizer: Any) -> list[int]:
    """2,048 tokens from characters 40,000 on: no overlap with `gate_ids`."""
    return tokenizer.encode(_topics(40000, 120000), add_special_tokens=False)[:2048]


def teacher_forced(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """The log-probability of each next token of `ids`, the text fed whole (one prefill, every position's logits)."""
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    with torch.inference_mode():
        logits = model(torch.tensor(ids), BatchLayout.build([Segment(0, 0, len(ids))]),
                       model.make_cache(1, model.dtype, "cpu"), all_logits=True)  # fmt: skip
    return torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def greedy(model: Any, prompts: Sequence[Sequence[int]], n: int = GREEDY_TOKENS) -> list[list[int]]:
    """Up to `n` greedy tokens after each of `prompts` (each stopping at EOS), decoding over the KV cache, all the
    prompts in one batch (a slot each): each step is one call for the answers still going, which on SmolLM2 took
    ~0.2x the time of one answer at a time and gave the same tokens (float32 and int8, all 10 `CHAT_PROMPTS`)."""
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    cache, answers = model.make_cache(len(prompts), model.dtype, "cpu"), [[] for _ in prompts]
    feed, start = {slot: list(p) for slot, p in enumerate(prompts)}, [0] * len(prompts)
    with torch.inference_mode():
        while feed:
            batch = BatchLayout.build([Segment(slot, start[slot], len(ids)) for slot, ids in feed.items()])
            logits = model(torch.tensor([t for ids in feed.values() for t in ids]), batch, cache)
            going = {}
            for row, (slot, ids) in enumerate(feed.items()):
                token = int(logits[row].argmax())
                answers[slot].append(token)
                start[slot] += len(ids)
                if len(answers[slot]) < n and token != EOS:
                    going[slot] = [token]
            feed = going
    return answers


def gates(ref: torch.Tensor, got: torch.Tensor, ref_answers: list[list[int]], answers: list[list[int]]) -> dict:
    """The issue's numbers: mean |Δ logprob|, perplexity ratio, identical greedy answers (and where each differs)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
             for x, y in zip(answers, ref_answers, strict=True)]  # fmt: skip
    return {
        "mean_abs_dlogprob": round((got.double() - ref.double()).abs().mean().item(), 4),
        "ppl_ratio": round(torch.exp(ref.double().mean() - got.double().mean()).item(), 4),
        "greedy_identical": sum(a == b for a, b in zip(answers, ref_answers, strict=True)),
        "first_difference": first,
    }


# --------------------------------------------------------------------------------------------------
# The study, on a float32 shard whose weights are swapped for their int8 round trips
# --------------------------------------------------------------------------------------------------


def fake_int8(w: torch.Tensor) -> torch.Tensor:
    """The round trip of the first int8 format, kept as the study's baseline: symmetric, one scale per output row."""
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp(-127, 127) * scale


def served_gates(model_dir: Path, ids: list[int], prompts: list[list[int]]) -> dict:
    """The issue's gates for `--quantize int8` as served: a float32 shard against an int8 one (`build_shard`, the
    kernels chosen at load, int8 groups of 32 with a float16 scale and minimum each), same text and prompts."""
    from shardmesh.core.dtypes import Quantization
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.loader import build_shard

    os.environ.pop("SHARDMESH_LINEAR_KERNEL", None)
    out = {}
    for q in (Quantization.NONE, Quantization.INT8):
        model = build_shard(model_dir, ShardSpec(0, 30, 30), max_len=len(ids) + 8, progress=False, quantization=q)
        out[q] = (teacher_forced(model, ids), greedy(model, prompts), model.linear_kernels)
        del model
    (ref, ref_answers, _), (got, answers, kernels) = out[Quantization.NONE], out[Quantization.INT8]
    return {"int8 groups of 32 (--quantize int8, served)": {**gates(ref, got, ref_answers, answers),
                                                            "kernels": kernels}}  # fmt: skip


def sensitivity(model: Any, ids: Sequence[int], ref: torch.Tensor) -> dict[str, float]:
    """Mean |Δ logprob| with one product in int8, for every product (layer-major names, `model.layers.L.kind`)."""
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    batch = BatchLayout.build([Segment(0, 0, len(ids))])
    cos, sin = (t[batch.positions].unsqueeze(1) for t in (model.rope_cos, model.rope_sin))
    cache, layers = model.make_cache(1, model.dtype, "cpu"), list(model.model.layers.values())
    with torch.inference_mode():
        inputs = [model.model.embed_tokens(torch.tensor(ids))]
        for layer in layers[:-1]:
            inputs.append(layer(inputs[-1], batch, cache, cos, sin))
    out = {}
    for i in range(len(layers)):
        for kind in KINDS:
            param = model.get_parameter(f"model.layers.{i}.{kind}.weight")
            kept = param.data.clone()
            param.data.copy_(fake_int8(kept))
            with torch.inference_mode():
                x = inputs[i]
                for layer in layers[i:]:
                    x = layer(x, batch, cache, cos, sin)
                logits = model.lm_head(model.model.norm(x)).float()
            got = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            param.data.copy_(kept)
            out[f"{i}.{kind}"] = round((got - ref).abs().mean().item(), 5)
            print(f"{i}.{kind}: {out[f'{i}.{kind}']}", file=sys.stderr, flush=True)
    return out


def _inputs(model: Any, ids: Sequence[int], reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`reduce` of each product's input rows (T, in), float32 model, over `ids`."""
    out, hooks = {}, []
    for name in _products(model):

        def hook(module: Any, args: tuple, name: str = name) -> None:
            out[name] = reduce(args[0].reshape(-1, args[0].shape[-1]).double())

        hooks.append(model.get_submodule(name).register_forward_pre_hook(hook))
    teacher_forced(model, ids)
    for h in hooks:
        h.remove()
    return out


def _products(model: Any) -> list[str]:
    return [f"model.layers.{i}.{k}" for i in model.layer_range for k in KINDS]


def smoothing_scales(model: Any, ids: Sequence[int], grid: int = 21) -> dict[str, torch.Tensor]:
    """AWQ's per-input-channel scales s = mean|x|^α (α searched on a grid per product for the least output error
    on 512 calibration rows): W·diag(s) is quantized and X·diag(1/s) computed, folded into the input's norm (qkv,
    gate_up) or producing product's rows (up rows for down, v rows for o: shared by the query heads of a kv
    head). α = 0 is plain int8, so no product gets worse on the calibration rows."""
    rows = torch.linspace(0, len(ids) - 1, 512).long()
    stats = _inputs(model, ids, lambda x: torch.cat([x.abs().mean(0)[None], x[rows]]))
    heads, kv = model.cfg.num_heads, model.cfg.num_kv_heads
    out = {}
    for name, st in stats.items():
        mean, x = st[0].float(), st[1:].float()
        if name.endswith("o_proj"):
            mean = mean.view(kv, heads // kv, -1).mean(1, keepdim=True).expand(kv, heads // kv, -1).reshape(-1)
        w = model.get_parameter(f"{name}.weight").data
        ref, best = x @ w.t(), (float("inf"), torch.ones_like(mean))
        for alpha in torch.linspace(0, 1, grid).tolist():
            s = mean.clamp(min=1e-5) ** alpha
            s = s / (s.max() * s.min()).sqrt()
            err = (x @ (fake_int8(w * s) / s).t() - ref).pow(2).mean().item()
            best = min(best, (err, s), key=lambda b: b[0])
        out[name] = best[1]
    return out


def gptq(w: torch.Tensor, hessian: torch.Tensor, block: int = 128) -> torch.Tensor:
    """GPTQ rounding (Frantar et al. 2022) onto the same per-row int8 grid, returned dequantized: each column's
    rounding error is spread over the columns not yet rounded, weighted by the input Hessian XᵀX."""
    w, n = w.double().clone(), w.shape[1]
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    h = hessian + 0.01 * hessian.diag().mean() * torch.eye(n, dtype=hessian.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for a in range(0, n, block):
        b = min(a + block, n)
        wb, err = w[:, a:b].clone(), torch.zeros_like(w[:, a:b])
        for i in range(b - a):
            q[:, a + i] = torch.round(wb[:, i] / scale).clamp(-127, 127) * scale
            err[:, i] = (wb[:, i] - q[:, a + i]) / hinv[a + i, a + i]
            wb[:, i:] -= err[:, i : i + 1] * hinv[a + i, a + i : b][None]
        w[:, b:] -= err @ hinv[a:b, b:]
    return q.float()


def variants(model: Any, ids: list[int], calib: list[int], prompts: list[list[int]], keep: list[str]) -> dict:
    """The gates for plain int8 and each candidate fix (module docstring), against the float32 model."""
    names = _products(model)
    weights = {n: model.get_parameter(f"{n}.weight").data.clone() for n in names}
    ref, ref_answers = teacher_forced(model, ids), greedy(model, prompts)
    smooth = smoothing_scales(model, calib)
    hessians = _inputs(model, calib, lambda x: x.t() @ x)
    rounders: dict[str, Callable[[str], torch.Tensor]] = {
        "bfloat16 weights": lambda n: weights[n].bfloat16().float(),
        "int8 (per row)": lambda n: fake_int8(weights[n]),
        f"int8, {len(keep)} most sensitive in float32": lambda n: weights[n] if n in keep else fake_int8(weights[n]),
        "int8 + AWQ-style scales": lambda n: fake_int8(weights[n] * smooth[n]) / smooth[n],
        f"int8 + AWQ-style scales, {len(keep)} most sensitive in float32": (
            lambda n: weights[n] if n in keep else fake_int8(weights[n] * smooth[n]) / smooth[n]),
        "int8 GPTQ rounding": lambda n: gptq(weights[n], hessians[n]),
    }  # fmt: skip
    out = {}
    for label, rounded in rounders.items():
        for n in names:
            model.get_parameter(f"{n}.weight").data.copy_(rounded(n))
        out[label] = gates(ref, teacher_forced(model, ids), ref_answers, greedy(model, prompts))
        print(label, out[label], file=sys.stderr, flush=True)
    for n in names:
        model.get_parameter(f"{n}.weight").data.copy_(weights[n])
    extra = sum(weights[n].numel() * 3 - 4 * weights[n].shape[0] for n in keep)  # float32 instead of int8 + scales
    return {"variants": out, "kept_in_float32": keep, "kept_extra_bytes": extra}


def llamacpp_gates(model_dir: Path, ids: list[int], prompts: list[list[int]]) -> dict:
    """llama.cpp's Q8_0 against its F32, both from `model_dir`'s GGUFs, on the same ids (no re-tokenizing)."""
    import llama_cpp
    import numpy as np

    def run(path: Path) -> tuple[torch.Tensor, list[list[int]]]:
        llm = llama_cpp.Llama(model_path=str(path), n_threads=2, n_threads_batch=2, n_ctx=len(ids) + 8,
                              n_batch=len(ids), logits_all=True, verbose=False)  # fmt: skip
        try:
            llm.reset()
            llm.eval(ids)
            logits = torch.tensor(np.array(llm.scores[: len(ids) - 1], dtype=np.float64))
            logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            answers = []
            for p in prompts:
                llm.reset()
                llm.eval(list(p))
                out: list[int] = []
                while len(out) < GREEDY_TOKENS and (not out or out[-1] != EOS):
                    out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                    llm.eval(out[-1:])
                answers.append(out)
        finally:
            llm.close()
        return logprobs, answers

    f32, q8 = run(model_dir / "model-f32.gguf"), run(model_dir / "model-q8_0.gguf")
    return {"llama.cpp Q8_0 against llama.cpp F32": gates(f32[0], q8[0], f32[1], q8[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", default="served,sensitivity,variants,llamacpp")
    ap.add_argument("--keep", type=int, default=2, help="most sensitive products kept in float32 (variants)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    os.environ["SHARDMESH_LINEAR_KERNEL"] = "dense"  # plain (out, in) weights, swapped in place
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.loader import build_shard
    from shardmesh.models.registry import resolve
    from shardmesh.models.tokenizer import Tokenizer

    model_dir = resolve(args.model)
    tok = Tokenizer.from_dir(model_dir)
    ids, prompts = gate_ids(tok), [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    model = build_shard(model_dir, ShardSpec(0, 30, 30), max_len=len(ids) + 8, progress=False)
    data: dict[str, Any] = {}
    steps = args.steps.split(",")
    if "served" in steps:
        data["served"] = served_gates(model_dir, ids, prompts)
        os.environ["SHARDMESH_LINEAR_KERNEL"] = "dense"
    if "sensitivity" in steps or "variants" in steps:
        ref = teacher_forced(model, ids)
        data["sensitivity"] = sensitivity(model, ids, ref)
    if "variants" in steps:
        keep = sorted(data["sensitivity"], key=data["sensitivity"].get)[-args.keep :]
        data.update(variants(model, ids, calibration_ids(tok), prompts, [f"model.layers.{k}" for k in keep]))
    if "llamacpp" in steps:
        data["llamacpp"] = llamacpp_gates(model_dir, ids, prompts)
    study = {"sensitivity", "variants", "llamacpp"} & set(steps)  # the first format's study keeps its own file
    info = machine()
    md = _markdown(data) + f"\nMachine: {info['cpu']} ({info['cpu_id']}), {info['cores']} cores, {info['date'][:10]}.\n"
    save_results(args.out, info, "-int8-quality" if study else "-int8-groups-quality", md, data)


def _markdown(data: dict) -> str:
    lines = ["# int8 quality on SmolLM2 (gates: mean |Δ logprob| <= 0.03, ppl ratio <= 1.02, greedy >= 8/10)", ""]
    if "sensitivity" in data:
        s = data["sensitivity"]
        lines += ["## One product in int8 at a time: mean |Δ logprob|", "", "| layer | " + " | ".join(KINDS) + " |",
                  "|---:|" + "---:|" * len(KINDS)]  # fmt: skip
        for i in sorted({int(k.split(".")[0]) for k in s}):
            lines.append(f"| {i} | " + " | ".join(f"{s[f'{i}.{k}']:.4f}" for k in KINDS) + " |")
        lines.append("")
    rows = {**data.get("served", {}), **data.get("variants", {}), **data.get("llamacpp", {})}
    if rows:
        lines += ["| variant | mean abs Δ logprob | ppl ratio | greedy identical of 10 |", "|---|---:|---:|---:|"]
        lines += [
            f"| {k} | {v['mean_abs_dlogprob']} | {v['ppl_ratio']} | {v['greedy_identical']} |" for k, v in rows.items()
        ]
        lines += [f"\n`{k}`: kernels {', '.join(v['kernels'])}" for k, v in rows.items() if "kernels" in v]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
