"""Build one shard: config → model on `meta` → tensor-parallel transform → read exactly its bytes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardmesh.core.config import ModelConfig
from shardmesh.core.layout import ShardSpec
from shardmesh.engine.checkpoint import Checkpoint, TensorRead, read_tensors
from shardmesh.engine.fuse import fuse_projections
from shardmesh.engine.groups import Collective, UnboundGroup
from shardmesh.engine.linear import can_pack, pack_weights
from shardmesh.engine.model import Transformer
from shardmesh.engine.tp import VocabParallelEmbedding, apply_tp, checkpoint_index

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(DTYPES)}") from None


def _source_name(cfg: ModelConfig, name: str) -> str:
    # Tied embeddings: the head reuses the embedding matrix, which checkpoints store once.
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def plan_reads(model: nn.Module, full_shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> list[TensorRead]:
    return [
        TensorRead(name, _source_name(cfg, name), full_shapes[name], checkpoint_index(model, name))
        for name, _ in model.named_parameters()
    ]


def meta_shard(
    cfg: ModelConfig, spec: ShardSpec, tp: Collective, max_len: int | None
) -> tuple[Transformer, list[TensorRead]]:
    """The shard's model on the meta device (no memory) and the checkpoint reads that will fill it."""
    with torch.device("meta"):
        model = Transformer(cfg, spec.layers, max_len=max_len)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    apply_tp(model, tp)
    return model, plan_reads(model, full_shapes, cfg)


def check_shards(model_dir: str | Path, specs: list[ShardSpec], cfg: ModelConfig | None = None) -> Checkpoint:
    """Validate that every shard can be built from this checkpoint, reading headers only.

    Run before starting any process, so a bad checkpoint or an impossible split fails once, clearly.
    """
    cfg = cfg or ModelConfig.from_dir(model_dir)
    ckpt = Checkpoint(model_dir)
    for spec in specs:
        _, reads = meta_shard(cfg, spec, UnboundGroup(spec.tp_rank, spec.tp_size), None)
        ckpt.check(reads)
    return ckpt


def _input_major(model: nn.Module) -> None:
    """Re-store every matrix that `F.linear` multiplies as the transpose of an (in, out) array.

    Same shape, same name, same values: only the memory order changes. `F.linear(x, W)` computes
    `x @ W.t()`, and with this layout `W.t()` is contiguous, which on CPUs is the faster GEMM for the
    few rows of a decode step (SmolLM2, all weights, one token: 41 -> 28 ms, see bench/). The
    embedding keeps its row-major layout: lookups read whole rows.
    """
    for module in model.modules():
        if isinstance(module, nn.Embedding) or getattr(module, "weight", None) is None:
            continue
        w = module.weight
        if w.dim() == 2 and not isinstance(module, VocabParallelEmbedding):
            module.weight = nn.Parameter(w.t().contiguous().t(), requires_grad=False)


def build_shard(
    model_dir: str | Path,
    spec: ShardSpec,
    tp: Collective | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_len: int | None = None,
    progress: bool = True,
    cfg: ModelConfig | None = None,
    fuse: bool = True,
) -> Transformer:
    """Load layers `spec.layers` (and tensor slice `spec.tp_rank`) of the checkpoint in `model_dir`.

    `fuse=False` keeps q/k/v and gate/up as separate products under their checkpoint names (for tests
    that compare loaded tensors by name); serving fuses them (`shardmesh/engine/fuse.py`)."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    if spec.num_layers != cfg.num_layers:
        raise ValueError(f"shard spec says {spec.num_layers} layers but config.json has {cfg.num_layers}")
    tp = tp or UnboundGroup(spec.tp_rank, spec.tp_size)
    if tp.size != spec.tp_size or tp.rank != spec.tp_rank:
        raise ValueError(f"group is rank {tp.rank} of {tp.size} but the spec says {spec.tp_rank} of {spec.tp_size}")
    ckpt = Checkpoint(model_dir)
    model, reads = meta_shard(cfg, spec, tp, max_len)
    tensors = read_tensors(ckpt, reads, dtype, device, progress)
    model.load_state_dict(tensors, strict=True, assign=True)
    del tensors  # the model holds them now; no second reference may outlive `_input_major`'s copies
    for p in model.parameters():
        p.requires_grad_(False)
    if fuse:
        fuse_projections(model)  # before packing: the stacked matrices are what gets packed
    if can_pack(dtype, torch.device(device)):
        pack_weights(model, skip=(nn.Embedding, VocabParallelEmbedding))  # oneDNN's layout: cpu_linear.py
    elif torch.device(device).type == "cpu":
        _input_major(model)  # one matrix at a time: each original is freed as its copy replaces it
    model.init_buffers(device)
    return model.eval()
