"""An 8B-shaped Llama on one GPU with half its layers streamed from pinned host memory, and int8 on the GPU.

    python bench/gpu_offload.py [--shape 8b] [--streams 1,16] [--steps 32] [--out DIR]

On a CUDA machine, in one process, one run, the same random bfloat16 checkpoint for every row:
  - the bounds: host-to-device copies of one streamed layer's bytes (the size the streamer copies) from pinned
    memory and from ordinary (pageable) memory, timed with CUDA events, the best of 5 after a warm-up;
  - shardmesh resident in bfloat16 (the baseline), then with a memory budget that streams half the decoder layers
    (`host_offload`: pinned host copies, a side copy stream, a ring of two device buffers), then int8 resident
    (`int8_cuda`'s Triton product), each decoding `--steps` greedy steps after 8 warm-up ones, replayed from CUDA
    graphs (the default), each step ending with the tokens on the host;
  - for the streamed shard: the streaming rate, bytes streamed per step (exactly the plan's) over the step time
    less the resident step time (what the resident half and the head take, the same in both), against the pinned
    bound; its greedy tokens against the resident shard's.

Writes <out>/<host>-<date>-gpu-offload.{md,json} and prints the markdown.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.conditions import machine, save_results  # noqa: E402
from bench.gpu_decode import SHAPES, WARMUP, shape_args, sync  # noqa: E402

PROBES = 5


def h2d_rate(nbytes: int, device: torch.device, pinned: bool) -> float:
    """Bytes per second of a host-to-device copy of `nbytes` (best of PROBES after one warm-up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for i in range(PROBES + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=pinned)
        end.record()
        end.synchronize()
        if i:
            rates.append(nbytes / (start.elapsed_time(end) / 1e3))
    return max(rates)


def shard(model_dir: Path, device: torch.device, max_len: int, **kw):
    from shardmesh.core.config import ModelConfig
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.loader import build_shard

    cfg = ModelConfig.from_dir(model_dir)
    spec = ShardSpec(0, cfg.num_layers, cfg.num_layers)
    t0 = time.perf_counter()
    model = build_shard(model_dir, spec, dtype=torch.bfloat16, device=device, max_len=max_len, progress=False,
                        **kw)  # fmt: skip
    return model, spec, time.perf_counter() - t0


def decode(model, spec, prompts: list[list[int]], steps: int, device: torch.device) -> tuple[float, list[list[int]]]:
    """Prefill each prompt, WARMUP decode steps, then `steps` timed: seconds per step and each stream's tokens."""
    from shardmesh.core.step import Segment
    from shardmesh.engine.batch import BatchLayout
    from shardmesh.engine.groups import ShardGroups, SingleRank
    from shardmesh.engine.stage import StageEngine

    n = len(prompts)
    cache = model.make_cache(n, torch.bfloat16, device)
    engine = StageEngine(model, ShardGroups(spec, 0, 1, SingleRank(), None, None), cache, device)
    out, lengths = [], []
    for slot, p in enumerate(prompts):
        logits = engine.step(BatchLayout.build([Segment(slot, 0, len(p))], device), torch.tensor(p))
        out.append([int(logits.argmax(-1)[0])])
        lengths.append(len(p))
    for i in range(WARMUP + steps):
        if i == WARMUP:
            sync(device)
            t0 = time.perf_counter()
        batch = BatchLayout.build([Segment(s, lengths[s], 1) for s in range(n)], device)
        tokens = engine.step(batch, torch.tensor([o[-1] for o in out])).argmax(-1).tolist()
        for s in range(n):
            out[s].append(tokens[s])
            lengths[s] += 1
    seconds = (time.perf_counter() - t0) / steps
    del engine, cache
    return seconds, out


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale")
    )


def main() -> None:
    ap = shape_args(__doc__, steps=32)
    ap.add_argument("--variants", default="resident,streamed,int8", help="which shards (resident always runs)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_offload.py needs a CUDA device")
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardmesh.core.dtypes import Quantization
    from shardmesh.engine.offload import stats, streamer_of

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    streams = [int(s) for s in a.streams.split(",")]
    info = {**machine(), "gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    config = LlamaConfig(**SHAPES[a.shape], rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(3, config.vocab_size, (n, a.prompt_tokens), generator=g).tolist() for n in streams}
    rows: list[dict] = []
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    with tempfile.TemporaryDirectory(prefix="shardmesh-gpu-") as tmp:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            hf = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
        hf.save_pretrained(tmp)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        setup_s = time.perf_counter() - t0

        max_len = a.prompt_tokens + WARMUP + a.steps + 8
        resident, spec, load_s = shard(Path(tmp), device, max_len)
        full = weight_bytes(resident)
        layer = next(iter(resident.model.layers.values()))
        products = sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if n.endswith("proj.weight"))
        bounds = {"pinned": h2d_rate(products, device, True), "pageable": h2d_rate(products, device, False)}
        print(f"bounds {bounds}, layer products {products / 1e6:.0f} MB", flush=True)
        variants = [("bfloat16, resident", resident, load_s, {})]
        half = config.num_hidden_layers // 2
        # every weight but half the layers' products, plus the ring of two layer buffers (and a MiB of slack)
        budget = full - half * products + 2 * products + 2**20
        for key, name, kw in [
            ("streamed", f"bfloat16, {half} of {config.num_hidden_layers} layers streamed", {"memory_budget": budget}),
            ("int8", "int8, resident", {"quantization": Quantization.INT8}),
        ]:
            if key in a.variants.split(","):
                variants.append((name, None, 0.0, kw))
        for name, model, load_s, kw in variants:
            if model is None:
                model, spec, load_s = shard(Path(tmp), device, max_len, **kw)
            for n in streams:
                s, out = decode(model, spec, prompts[n], a.steps, device)
                tokens[(name, n)] = out
                row = {"engine": name, "streams": n, "step_ms": s * 1e3, "weights_on_device": weight_bytes(model),
                       "load_s": load_s, "kernels": model.linear_kernels}  # fmt: skip
                streamer = streamer_of(model)
                if streamer is not None:
                    st = stats(model)
                    row |= {"streamed_layers": len(streamer.plan.streamed_layers), "budget": budget,
                            "plan_bytes_per_step": streamer.plan.streamed_bytes_per_step,
                            "engine_bound_Bps": st.bound_bytes_per_second,
                            "device_memory_held": torch.cuda.memory_allocated(device)}  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()
    base = {r["streams"]: r["step_ms"] for r in rows if r["engine"] == "bfloat16, resident"}
    for r in rows:
        r["vs_resident"] = base[r["streams"]] / r["step_ms"]
        if "plan_bytes_per_step" in r:
            r["stream_Bps"] = r["plan_bytes_per_step"] / (r["step_ms"] / 1e3)  # the whole step: a lower bound
            r["of_pinned_bound"] = r["stream_Bps"] / bounds["pinned"]
            r["same_tokens_as_resident"] = tokens[(r["engine"], r["streams"])] == tokens[("bfloat16, resident",
                                                                                          r["streams"])]  # fmt: skip
    md = [f"# Offload and int8 on {info['gpu']}: {a.shape}-shaped Llama, bfloat16, random weights\n",
          f"{info['date']}, torch {info['torch']}, CUDA {info['cuda']}. Host-to-device copy of one layer's products "
          f"({products / 1e6:.0f} MB): pinned {bounds['pinned'] / 1e9:.1f} GB/s, pageable "
          f"{bounds['pageable'] / 1e9:.1f} GB/s. Weights {full / 1e9:.2f} GB resident; prompt {a.prompt_tokens} "
          f"tokens, {a.steps} greedy steps timed after {WARMUP}, replayed from CUDA graphs, each ending with the "
          f"tokens on the host. Same run, same weights (setup {setup_s:.0f} s).\n",
          "| shard | streams | ms/step | vs resident | weights on GPU | streamed GB/s | of pinned bound "
          "| tokens = resident |",
          "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        streamed = (f"{r['stream_Bps'] / 1e9:.1f} | {r['of_pinned_bound']:.0%} | {r['same_tokens_as_resident']}"
                    if "stream_Bps" in r else " | | ")  # fmt: skip
        md.append(f"| {r['engine']} | {r['streams']} | {r['step_ms']:.2f} | {r['vs_resident']:.2f}x | "
                  f"{r['weights_on_device'] / 1e9:.2f} GB | {streamed} |")  # fmt: skip
    md.append("\nStreamed GB/s: the plan's bytes per step over the whole step's time (the resident half's compute and "
              "the head included, so a lower bound on the copies' own rate).")  # fmt: skip
    data = {"bounds_Bps": bounds, "layer_product_bytes": products, "rows": rows, "args": vars(a) | {"out": str(a.out)}}
    save_results(a.out, info, "-gpu-offload", "\n".join(md), data)


if __name__ == "__main__":
    main()
