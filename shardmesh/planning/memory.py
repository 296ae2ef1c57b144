"""How many bytes one shard needs, from config.json (and safetensors headers) alone: no weight is read.

Notation, per shard (stage `s` × tensor rank `r` of `tp`); `b` is the bytes of the serving dtype
(4 for float32, 2 for bfloat16 / float16), `n` the number of layers the stage holds:

  weights     = Σ numel × b over the slices the shard reads (`weights.shard_slices`: the layout
                `shardmesh.engine.loader.meta_shard` builds, counted from the config), so tensor-parallel
                slices, replicated kv heads, an uneven vocabulary split and untied / tied heads count
                exactly as loaded. All decoder layers have the same shapes, so the count is
                n × (one layer) + embedding (first stage) + norm and LM head (last stage).
                With int8 (`Quantization.INT8`) each product of a layer (qkv, o, gate_up, down: `Part.products`)
                and the LM head (`shardmesh.engine.linear.int8_products`) is out × in × 1 + out × ⌈in / 32⌉ × 4
                bytes: int8 values and a float16 scale and minimum per 32 inputs of a local output row. Norms,
                biases and the embedding stay in b.
  kv_cache    = n × 2 × kv_slots × kv_heads_local × max_context × head_dim × b
                (the `KVCache` tensor: layers × {k, v} × slots × kv heads × positions × head_dim)
                + on every stage but the last: kv_slots × max_context × H × b (the `ActivationLog`: what the
                stage sent on, kept so that a replacement of the next stage replays without recomputing it;
                allocated untouched, so it is resident only as far as sequences reach, but planned in full)
                A paged cache (`limits.kv_block_size` > 0) instead: kv_blocks × the bytes of one block
                (`planning.kv_blocks.block_bytes`: the same per position, keys, values and log, for kv_blocks ×
                kv_block_size positions shared by every sequence)
  buffers     = 2 × max_context × head_dim × 4        (rope cos and sin tables, always float32)
  activations = T × ( b × (2H + max(3F, 4Q + 3K)) + 8H + 8·head_dim )  +  T × max_context
                + on the last stage: B × V × (2b + 16)
                with T = max_batch_tokens, H = hidden, F = intermediate / tp, Q = q_heads_local × head_dim,
                K = kv_heads_local × head_dim, V = vocab, B = min(kv_slots, T). Read as: the residual and
                the normed input (2H) plus, whichever is larger, the MLP's live SwiGLU tensors (silu(gate),
                up, their product: 3F) or attention's q with its rotary temporaries and k, v (4Q + 3K);
                RMSNorm's float32 copies (8H bytes per token) and the gathered rope rows (8·head_dim);
                the boolean mask of a chunked prompt (1 byte × T × max_context); and on the last stage the
                sampled rows' logits in the serving dtype, gathered (2b) and in float32 for sampling (16).
                Attention itself is assumed fused (SDPA flash / memory-efficient): no T × T score matrix.
                On a CPU the compiled layer halves (`engine.cpu_decode`) take the step instead where they can, a
                chunk of C = min(T, CPU_ROW_CHUNK) rows at a time with float32 scratch: the activations are then
                the larger of the above and T × 2H × b (the step's input and output) + C × 4 × (2H + max(3F,
                2Q + 2K)) (a half's normed input and output, and the MLP's gate, up and product or attention's
                q, k, v and output).
  load        = the transient of loading, on top of the weights:
                cpu:  max(2 × S × c, M × b). Reading holds one tensor at a time twice: its mapped file
                      pages and the slice safetensors returns (S = the shard's largest tensor slice in
                      elements, c = bytes of the checkpoint's dtype; `shardmesh.engine.reads._read_into`).
                      Then `build_shard` re-stores every matrix for its kernel (`shardmesh.engine.linear.
                      LinearProduct.use_kernel`), one at a time, each original freed as its copy replaces it:
                      M = elements of the shard's largest 2-D parameter but the embedding.
                cuda: S × c (slices are read on the host; at most one is staged on the device).
                int8: the largest of the above and P × b + min(P, Q) × t, P = elements of the shard's largest
                product: it is read whole in b, then `linear.quantize_groups` quantizes Q =
                `INT8_QUANTIZE_CHUNK` elements at a time with at most t = `INT8_QUANTIZE_TEMP_BYTES` bytes of
                float64 temporaries each, before its int8 copy (counted in weights) replaces it. Products are
                not re-laid out in float (the int8 kernels block the int8 values): M counts only the LM head's
                matrix.
  runtime     = the fixed cost of a worker process (`RuntimeCosts`), measured on CPU.

Peak = runtime + weights + buffers + max(load, kv_cache + activations): loading finishes (and frees its
transient) before the KV cache is reserved and the first step runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import INT8_QUANTIZE_CHUNK, INT8_QUANTIZE_TEMP_BYTES, DType, Quantization
from shardmesh.core.heads import HeadSplit, TpSplit, mlp_range
from shardmesh.core.step import CPU_ROW_CHUNK
from shardmesh.core.topology import ServingLimits
from shardmesh.models.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint, TensorRead
from shardmesh.planning.kv_blocks import block_bytes
from shardmesh.planning.weights import Part, checkpoint_shapes, weight_parts

# --- measured constants -----------------------------------------------------------------------------------
#
# WORKER_RSS_BYTES: the resident set of a `shardmesh worker` process that holds (almost) nothing: a
# 2-layer Llama (hidden 64; 0.35-0.41 MiB of tensors) under a real coordinator, pp=2, tp=1 (and 2),
# OMP_NUM_THREADS=1, CPU, torch 2.13: python, torch, gRPC, the shardworker modules, the gRPC server and
# its threads, the Gloo groups, after one step. Measured as VmHWM in /proc/PID/status of each worker
# minus its tensors, by `python -m bench.worker_memory`. It depends on the page cache: ~60 MiB
# of it are file-backed pages of torch's shared libraries, and a freshly installed venv maps more of
# them per fault (321.8 MiB on this 2-core machine, as CI sees it) than one whose files were read
# before (257.7 MiB, same machine and packages). The planner keeps the fresh-install figure, the
# larger; `calibrate` measures the machine at hand and the memory test uses that measurement.
WORKER_RSS_BYTES = 322 * 2**20
# FIRST_STAGE_EXTRA_BYTES: what the worker holding the first stage (the embedding) pays beyond the others,
# tensors aside. It was 71.6 - 71.7 MiB while `nn.Embedding` was built with its random init on the meta
# device (that imported torch's dynamo stack); the embedding is now built from an empty `_weight`, and
# calibrate measures stage 0 at 257.5 MiB against 258.2 MiB for stage 1: nothing left to add.
FIRST_STAGE_EXTRA_BYTES = 0
# CUDA_RUNTIME_BYTES: device memory a CUDA worker pays before any tensor (context, cuBLAS workspace).
# NOT measured here (the development machine has no GPU): 1 GiB is an upper estimate of a torch 2.x
# context on current NVIDIA GPUs; measure yours (nvidia-smi after `torch.cuda.init()` and one matmul)
# and pass it as `--runtime-overhead` / `placement.runtime_overhead`.
CUDA_RUNTIME_BYTES = 2**30


@dataclass(frozen=True)
class RuntimeCosts:
    """Fixed bytes a worker process costs beyond its tensors, and which memory is planned.

    `device` "cpu": host RSS, with the measured constants above. "cuda": device memory, where the
    process pays its CUDA context instead and host-side costs (imports, the CPU relayout) do not count.
    """

    device: str = "cpu"
    process: int = WORKER_RSS_BYTES
    first_stage: int = FIRST_STAGE_EXTRA_BYTES

    @classmethod
    def for_device(cls, device: str, process: int | None = None) -> RuntimeCosts:
        """Defaults for `cpu` or `cuda` (`cuda:N` too); `process` overrides the per-process bytes."""
        kind = device.split(":")[0]
        if kind == "cpu":
            return cls("cpu", WORKER_RSS_BYTES if process is None else process, FIRST_STAGE_EXTRA_BYTES)
        if kind == "cuda":
            return cls("cuda", CUDA_RUNTIME_BYTES if process is None else process, 0)
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


@dataclass(frozen=True)
class ModelInfo:
    """A model to plan for: its config, and what is known of its checkpoint (maybe nothing)."""

    cfg: ModelConfig
    name: str
    path: Path
    checkpoint_dtype: str  # the `DType` the weights are stored in (headers, or config.json's torch_dtype)
    has_weights: bool  # False: planned from config.json alone


@dataclass(frozen=True)
class ShardMemory:
    """Bytes of one shard, by purpose; `total` is the predicted peak (see the module docstring)."""

    weights: int
    kv_cache: int
    activations: int
    buffers: int
    load: int
    runtime: int

    @property
    def other(self) -> int:
        """Everything but weights and KV cache at the peak: runtime, buffers and the larger transient."""
        return self.total - self.weights - self.kv_cache

    @property
    def total(self) -> int:
        """The peak: loading, or serving, whichever holds more."""
        return self.runtime + self.weights + self.buffers + max(self.load, self.kv_cache + self.activations)

    @property
    def serving(self) -> int:
        """Resident while serving, after the load transient is gone."""
        return self.runtime + self.weights + self.buffers + self.kv_cache + self.activations


def shard_memory(
    model: ModelInfo,
    layers: tuple[int, int],
    tp: int,
    rank: int,
    dtype: str,
    limits: ServingLimits,
    runtime: RuntimeCosts = RuntimeCosts(),  # frozen, so a shared default is safe
    quantization: Quantization | str = Quantization.NONE,
    split: TpSplit = (),
) -> ShardMemory:
    """The bytes of the shard holding layers [start, end) × tensor rank `rank` of `tp` (module docstring), its MLP
    and vocabulary by `split`'s shares (evenly when it is empty)."""
    start, end = layers
    if not 0 <= start < end <= model.cfg.num_layers:
        raise ValueError(f"layer range [{start}, {end}) is not within [0, {model.cfg.num_layers})")
    last = end == model.cfg.num_layers
    return stage_memory(model, end - start, start == 0, last, tp, rank, dtype, limits, runtime, quantization, split)


def stage_memory(
    model: ModelInfo,
    n: int,
    first: bool,
    last: bool,
    tp: int,
    rank: int,
    dtype: str,
    limits: ServingLimits,
    runtime: RuntimeCosts = RuntimeCosts(),  # frozen, so a shared default is safe
    quantization: Quantization | str = Quantization.NONE,
    split: TpSplit = (),
) -> ShardMemory:
    """`shard_memory` by position: `n` layers (any n >= 1, even more than the model has, for capacity
    searches), plus the embedding when `first` and the final norm and LM head when `last`; the layers'
    products stored as `quantization` says."""
    cfg, serving = model.cfg, DType.parse(dtype)
    b, quant = serving.itemsize, Quantization.parse(str(quantization))
    parts = weight_parts(cfg, tp, rank, split)
    held = [(n, parts.layer)] + [(1, parts.embedding)] * first + [(1, parts.head)] * last  # (count, part)
    weights = sum(count * part.nbytes(serving, quant) for count, part in held)
    heads = HeadSplit.of(cfg, rank, tp)
    hd = cfg.head_dim
    if limits.kv_block_size:
        kv = limits.kv_blocks * block_bytes(n, heads.kv_count, hd, cfg.hidden_size, limits.kv_block_size, b, last)
    else:
        kv = n * 2 * limits.kv_slots * heads.kv_count * limits.max_context * hd * b
        if not last:
            kv += limits.kv_slots * limits.max_context * cfg.hidden_size * b
    buffers = 2 * limits.max_context * hd * 4
    ffn_start, ffn_end = mlp_range(cfg, rank, tp, split)
    t, h, f = limits.max_batch_tokens, cfg.hidden_size, ffn_end - ffn_start
    q, k = heads.q_count * hd, heads.kv_count * hd
    acts = t * (b * (2 * h + max(3 * f, 4 * q + 3 * k)) + 8 * h + 8 * hd) + t * limits.max_context
    if runtime.device == "cpu":
        chunk = min(t, CPU_ROW_CHUNK)
        acts = max(acts, t * 2 * h * b + chunk * 4 * (2 * h + max(3 * f, 2 * q + 2 * k)))
    if last:
        acts += min(limits.kv_slots, t) * cfg.vocab_size * (2 * b + 16)
    load = _load_transient(model, [part for _, part in held], b, quant, runtime.device == "cpu")
    fixed = runtime.process + first * runtime.first_stage
    return ShardMemory(weights, kv, acts, buffers, load, fixed)


def _load_transient(model: ModelInfo, held: list[Part], b: int, quant: Quantization, cpu: bool) -> int:
    """The `load` term of the module docstring: bytes loading holds beyond the weights, at its peak."""
    c = DType(model.checkpoint_dtype).itemsize
    read = max(part.largest_read for part in held) * c
    quantized = [part for part in held if part.products] if quant is Quantization.INT8 else []
    # int8 products keep the layout they were loaded in: only the float matrices (the LM head) are re-laid out.
    relayout = max((part.largest_matrix for part in held if part not in quantized), default=0) * b if cpu else 0
    transient = [2 * read if cpu else read, relayout]
    for part in quantized:  # as read, plus quantize_groups' float64 temporaries for one chunk of rows
        transient.append(
            part.largest_product * b + min(part.largest_product, INT8_QUANTIZE_CHUNK) * INT8_QUANTIZE_TEMP_BYTES
        )
    return max(transient)


def _config_dtype(raw: dict[str, Any], default: str) -> str:
    """HF configs name the stored dtype `torch_dtype` (or `dtype` in transformers 5)."""
    name = raw.get("torch_dtype") or raw.get("dtype")
    return (DType.from_hf(str(name)) or default) if name else default


def load_model(path: str | Path, default_dtype: str = DType.BFLOAT16) -> ModelInfo:
    """A model directory with config.json, and safetensors weights or not.

    With weights, every tensor's header is checked against the shape config.json implies (as the
    coordinator does before serving; headers only, `shardmesh.models.checkpoint`) and the stored dtype is
    that of the largest tensor; without, the stored dtype is config.json's `torch_dtype`, else
    `default_dtype`.
    """
    d = Path(path).expanduser()
    if d.is_file() and d.name.endswith(".json"):
        d = d.parent
    cfg = ModelConfig.from_dir(d)
    raw = json.loads((d / "config.json").read_text())
    name = str(raw.get("_name_or_path") or d.name)
    if not ((d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file()):
        return ModelInfo(cfg, name, d, _config_dtype(raw, default_dtype), has_weights=False)
    ckpt = Checkpoint(d)
    ckpt.check([TensorRead(source, source, shape, None) for source, shape in checkpoint_shapes(cfg).items()])
    stored = max(ckpt.tensors.values(), key=lambda t: t.nbytes).dtype if ckpt.tensors else "F32"
    return ModelInfo(cfg, name, d, DType.from_hf(stored) or DType.FLOAT32, has_weights=True)
