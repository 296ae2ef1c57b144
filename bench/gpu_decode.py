"""Decode of an 8B-shaped Llama on one GPU: shardmesh's engine (eager and CUDA graphs) against `transformers`.

    python bench/gpu_decode.py [--shape 8b] [--streams 1,16] [--prompt-tokens 128] [--steps 64] [--out DIR]

On a CUDA machine, in one process, one run:
  - the HBM floor: a device-to-device copy of 4 GiB, timed; bandwidth = bytes read + bytes written per second.
    A decode step must read every weight it multiplies once, so its floor is (weight bytes read per step) /
    bandwidth; "of floor" is that floor over the measured step time.
  - `transformers`' LlamaForCausalLM built from the Llama-3-8B config with random weights, in bfloat16, on the
    GPU, saved as safetensors; shardmesh loads that same checkpoint (`build_shard`, one stage, the serving path),
    so both compute with the same weights.
  - for each stream count: the prompt prefilled, then `--steps` greedy decode steps timed (after 8 warm-up
    steps, which capture the graphs), each step ending with the sampled token ids on the host, as a server's
    does. transformers: its model called with a DynamicCache (what `generate` does by default), eager.
  - agreement: teacher-forced on transformers' greedy tokens, the largest logprob difference of the chosen
    token and the tokens that differ where transformers' top two are further apart than 0.1.

Writes <out>/<host>-<date>-gpu-decode.{md,json} and prints the markdown.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402

SHAPES = {
    # Llama-3-8B's geometry
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # a small one, to try the script
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, max_position_embeddings=1024),
}  # fmt: skip
WARMUP = 8
MARGIN = 0.1
AGREE_STEPS = 32


def shape_args(doc: str | None, steps: int) -> argparse.ArgumentParser:
    """The arguments the GPU decode benches share: the model's shape, the streams, the prompt, the steps timed."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    return ap


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, size: int = 4 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy of `size` bytes (median of 20)."""
    x = torch.empty(size, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(23):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    del x, y
    return 2 * size / sorted(times)[len(times) // 2]


def weight_bytes_per_step(model: torch.nn.Module, embedding: torch.nn.Module) -> int:
    """Bytes of every parameter a decode step reads whole: all but the embedding (one row of it per token)."""
    skip = {id(p) for p in embedding.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def timed(step, prompts: list[list[int]], steps: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """Prefill, WARMUP decode steps, then `steps` timed: seconds per step and each stream's tokens."""
    tokens = step(prompts, None)
    out = [[t] for t in tokens]
    for i in range(WARMUP + steps):
        if i == WARMUP:
            sync(device)
            t0 = time.perf_counter()
        tokens = step(None, tokens)
        for o, t in zip(out, tokens, strict=True):
            o.append(t)
    return (time.perf_counter() - t0) / steps, out


def ours_runner(model_dir: Path, streams: int, max_len: int, graphs: bool, device: torch.device, compile: bool = False):
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.layout import ShardSpec
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout
    from shardmesh.engine.groups import ShardGroups, SingleRank
    from shardmesh.engine.loader import build_shard
    from shardmesh.engine.stage import StageEngine

    cfg = ModelConfig.from_dir(model_dir)
    spec = ShardSpec(0, cfg.num_layers, cfg.num_layers)
    model = build_shard(model_dir, spec, dtype=torch.bfloat16, device=device, max_len=max_len, progress=False)
    cache = model.make_cache(streams, torch.bfloat16, device)
    groups = ShardGroups(spec, 0, 1, SingleRank(), None, None)
    engine = StageEngine(model, groups, cache, device, cuda_graphs=graphs, compile=compile)
    lengths = [0] * streams

    def step(prompts: list[list[int]] | None, last: list[int] | None) -> list[int]:
        if prompts is not None:
            out = []
            for slot, p in enumerate(prompts):  # each prompt in its own step, as the scheduler's chunks
                logits = engine.step(BatchLayout.build([Segment(slot, 0, len(p))], device), torch.tensor(p))
                lengths[slot] = len(p)
                out.append(int(logits.argmax(-1)[0]))
            return out
        assert last is not None
        batch = BatchLayout.build([Segment(s, lengths[s], 1) for s in range(streams)], device)
        logits = engine.step(batch, torch.tensor(last))
        for s in range(streams):
            lengths[s] += 1
        return logits.argmax(-1).tolist()

    return engine, step


def hf_runner(model, device: torch.device):
    from transformers import DynamicCache

    state: dict = {}

    @torch.inference_mode()
    def step(prompts: list[list[int]] | None, last: list[int] | None) -> list[int]:
        if prompts is not None:
            state["past"] = DynamicCache(config=model.config)
            ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
            logits = model(ids, past_key_values=state["past"], use_cache=True).logits[:, -1]
            return logits.argmax(-1).tolist()
        ids = torch.tensor(last, device=device)[:, None]
        logits = model(ids, past_key_values=state["past"], use_cache=True).logits[:, -1]
        return logits.argmax(-1).tolist()

    return step


@torch.inference_mode()
def agreement(engine, hf, prompt: list[int], steps: int, device: torch.device) -> dict:
    """Teacher-forced on transformers' greedy tokens: logprob differences, and tokens that differ at margins."""
    from transformers import DynamicCache

    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout

    past = DynamicCache(config=hf.config)
    ref = hf(torch.tensor([prompt], device=device), past_key_values=past, use_cache=True).logits[0, -1].float()
    ours = engine.step(BatchLayout.build([Segment(0, 0, len(prompt))], device), torch.tensor(prompt))[0]
    worst, flips, compared = 0.0, 0, 0
    pos = len(prompt)
    for _ in range(steps):
        ref_lp, our_lp = torch.log_softmax(ref, -1), torch.log_softmax(ours.float(), -1)
        token = int(ref_lp.argmax())
        top2 = ref_lp.topk(2).values
        worst = max(worst, abs(float(ref_lp[token] - our_lp[token])))
        if float(top2[0] - top2[1]) > MARGIN:
            compared += 1
            flips += int(our_lp.argmax()) != token
        ref = hf(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True).logits[0, -1].float()
        ours = engine.step(BatchLayout.build([Segment(0, pos, 1)], device), torch.tensor([token]))[0]
        pos += 1
    return {"max_logprob_diff": worst, "tokens_compared": compared, "tokens_differing": flips}


def main() -> None:
    ap = shape_args(__doc__, steps=64)
    ap.add_argument("--compile", action="store_true", help="also torch.compile the captured step")
    ap.add_argument("--device", default="cuda:0", help="cpu only to try the script (--shape tiny)")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_decode.py needs a CUDA device")
    from transformers import LlamaConfig, LlamaForCausalLM

    if device.type == "cuda":
        torch.cuda.set_device(device)
    streams = [int(s) for s in a.streams.split(",")]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {**machine(), "gpu": gpu, "cuda": torch.version.cuda}
    bandwidth = copy_bandwidth(device, 4 << 30 if device.type == "cuda" else 256 << 20)
    config = LlamaConfig(**SHAPES[a.shape], rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    max_len = a.prompt_tokens + WARMUP + max(a.steps, AGREE_STEPS) + 8
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, config.vocab_size, (n, a.prompt_tokens), generator=g).tolist() for n in streams}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shardmesh-gpu-") as tmp:
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with torch.device(device):
            hf = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
        hf.save_pretrained(tmp)
        setup_s = time.perf_counter() - t0
        hf_bytes = weight_bytes_per_step(hf, hf.model.embed_tokens)
        for n in streams:
            s, _ = timed(hf_runner(hf, device), prompts[n], a.steps, device)
            rows.append({"engine": "transformers (eager, DynamicCache)", "streams": n, "step_ms": s * 1e3,
                         "weight_bytes": hf_bytes})  # fmt: skip
        variants = [(False, False), (True, False)] + ([(True, True)] if a.compile else [])
        for graphs, compile in variants:
            for n in streams:
                t0 = time.perf_counter()
                engine, step = ours_runner(Path(tmp), n, max_len, graphs, device, compile)
                s, _ = timed(step, prompts[n], a.steps, device)
                ours_bytes = weight_bytes_per_step(engine.model, engine.model.model.embed_tokens)
                row = {
                    "engine": f"shardmesh ({engine.decode_runner})",
                    "streams": n,
                    "step_ms": s * 1e3,
                    "weight_bytes": ours_bytes,
                    "build_and_warm_s": time.perf_counter() - t0 - s * a.steps,
                }
                if engine.graphs is not None:  # the graph alone, replayed back to back: the GPU's time
                    graph = next(iter(engine.graphs.graphs.values())).graph
                    sync(device)
                    t1 = time.perf_counter()
                    for _ in range(20):
                        graph.replay()
                    sync(device)
                    row["replay_ms"] = (time.perf_counter() - t1) / 20 * 1e3
                rows.append(row)
                print(row, flush=True)
                if graphs and n == streams[0]:
                    engine1, _ = ours_runner(Path(tmp), 1, max_len, True, device)
                    agree = agreement(engine1, hf, prompts[n][0], AGREE_STEPS, device)
                    del engine1
                del engine, step
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    base = {r["streams"]: r["step_ms"] for r in rows if r["engine"].startswith("transformers")}
    for r in rows:
        floor_ms = r["weight_bytes"] / bandwidth * 1e3
        r["tokens_per_s"] = r["streams"] * 1e3 / r["step_ms"]
        r["of_floor"] = floor_ms / r["step_ms"]
        r["vs_transformers"] = base[r["streams"]] / r["step_ms"]
    md = [f"# Decode on {info['gpu']}: {a.shape}-shaped Llama, bfloat16, random weights\n",
          f"{info['date']}, torch {info['torch']}, CUDA {info['cuda']}. Copy bandwidth (read + write) "
          f"{bandwidth / 1e12:.2f} TB/s; weights read per step {rows[0]['weight_bytes'] / 1e9:.2f} GB, floor "
          f"{rows[0]['weight_bytes'] / bandwidth * 1e3:.2f} ms. Prompt {a.prompt_tokens} tokens, {a.steps} greedy "
          f"steps timed after {WARMUP}; each step ends with the tokens on the host. Same run, same weights "
          f"(transformers' random init, saved and loaded by shardmesh; setup {setup_s:.0f} s).\n",
          "| engine | streams | ms/step | tokens/s | of HBM floor | vs transformers |",
          "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        md.append(f"| {r['engine']} | {r['streams']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{r['of_floor']:.0%} | {r['vs_transformers']:.2f}x |")  # fmt: skip
    md.append(
        f"\nAgreement (shardmesh with graphs, teacher-forced on transformers' greedy tokens, {AGREE_STEPS} "
        f"steps): largest logprob difference {agree['max_logprob_diff']:.4f}; {agree['tokens_differing']} of "
        f"{agree['tokens_compared']} tokens differ where transformers' top two are > {MARGIN} apart.\n"
    )
    data = {"bandwidth_Bps": bandwidth, "rows": rows, "agreement": agree, "args": vars(a) | {"out": str(a.out)}}
    save_results(a.out, info, "-gpu-decode", "\n".join(md), data)


if __name__ == "__main__":
    main()
