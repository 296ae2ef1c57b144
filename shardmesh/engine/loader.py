"""Build one shard: config → model on `meta` → tensor-parallel transform → read exactly its bytes."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch
from torch import nn

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import INT8_GROUP, DType, Quantization
from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import Collective, UnboundGroup
from shardmesh.engine.linear import Linear, LinearProduct, choose_kernel, int8_products, quantize_groups
from shardmesh.engine.model import Transformer
from shardmesh.engine.offload import is_streamed, stream_layers
from shardmesh.engine.reads import read_tensors
from shardmesh.engine.tp import apply_tp, checkpoint_index
from shardmesh.models.checkpoint import Checkpoint, TensorRead

log = structlog.get_logger()

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[DType(name)]
    except ValueError:
        raise ValueError(f"dtype {name!r} is not supported; expected one of {sorted(DType.names())}") from None


# Per parameter: the checkpoint tensors it is made of, in row order, with their full shapes.
Sources = dict[str, list[tuple[str, tuple[int, ...]]]]


def _sources(model: Transformer) -> Sources:
    """Each parameter of the unsharded meta model: the checkpoint tensors it is made of, in row order,
    with their full shapes. A stacked product's blocks are tensors of their own (`q_proj.weight` ...)."""
    out: Sources = {}
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, Linear) and module.blocks:
            parent = path.rpartition(".")[0]
            out[name] = [(f"{parent}.{b.name}.{leaf}", (b.rows, *p.shape[1:])) for b in module.blocks]
        elif name == "lm_head.weight" and model.cfg.tie_word_embeddings:
            # Tied embeddings: the head reuses the embedding matrix, which checkpoints store once.
            out[name] = [("model.embed_tokens.weight", tuple(p.shape))]
        else:
            out[name] = [(name, tuple(p.shape))]
    return out


def plan_reads(model: nn.Module, sources: Sources) -> list[TensorRead]:
    """The reads that fill `model` (tensor-parallel or not): each parameter's blocks, sliced as
    `tp.checkpoint_index` records, stacked one after another along its rows."""
    reads = []
    for name, _ in model.named_parameters():
        index = checkpoint_index(model, name)
        row = 0
        for i, (source, full_shape) in enumerate(sources[name]):
            read = TensorRead(name, source, full_shape, index[i] if index is not None else None, row)
            reads.append(read)
            row += read.shape[0]
    return reads


def meta_shard(
    cfg: ModelConfig, spec: ShardSpec, tp: Collective, max_len: int | None
) -> tuple[Transformer, list[TensorRead]]:
    """The shard's model on the meta device (no memory) and the checkpoint reads that will fill it."""
    with torch.device("meta"):
        model = Transformer(cfg, spec.layers, max_len=max_len)
    sources = _sources(model)
    apply_tp(model, tp, spec.tp_split)
    return model, plan_reads(model, sources)


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
    quantization: Quantization = Quantization.NONE,
    memory_budget: int | None = None,
) -> Transformer:
    """Load layers `spec.layers` (and tensor slice `spec.tp_rank`) of the checkpoint in `model_dir`, with
    every product computed by the kernel `linear.choose_kernel` picks for `dtype` on `device`.

    With `Quantization.INT8` the decoder layers' products are quantized as each is read (`Int8Finish`): the shard
    never holds more than one of them in float.

    With `memory_budget` (bytes of weights in memory), the leading layers that fit are loaded and the others'
    products stream from the checkpoint file for every step (`offload`, which says what the budget counts).
    """
    cfg = cfg or ModelConfig.from_dir(model_dir)
    if spec.num_layers != cfg.num_layers:
        raise ValueError(f"shard spec says {spec.num_layers} layers but config.json has {cfg.num_layers}")
    tp = tp or UnboundGroup(spec.tp_rank, spec.tp_size)
    if tp.size != spec.tp_size or tp.rank != spec.tp_rank:
        raise ValueError(f"group is rank {tp.rank} of {tp.size} but the spec says {spec.tp_rank} of {spec.tp_size}")
    ckpt = Checkpoint(model_dir)
    model, reads = meta_shard(cfg, spec, tp, max_len)
    if memory_budget is not None:  # the reads left to load
        reads = stream_layers(ckpt, model, reads, dtype, device, memory_budget, quantization, progress)
    for p in model.parameters():
        p.requires_grad_(False)  # before loading: an int8 tensor cannot be a parameter that requires grad
    int8 = Int8Finish(model) if quantization is Quantization.INT8 else None
    tensors = read_tensors(ckpt, reads, dtype, device, progress, finish=int8)
    model.load_state_dict(tensors, strict=True, assign=True)
    del tensors  # the model holds them now; no second reference may outlive `use_kernel`'s copies
    # The int8 kernel only for a shard with int8 products: choosing it may compile it (`int8_cpu`).
    kernels = {False: choose_kernel(dtype, device)}
    if int8 is not None:
        kernels[True] = choose_kernel(dtype, device, quantized=True)
    for name, module in model.named_modules():
        if isinstance(module, LinearProduct) and not is_streamed(module):
            if int8 is not None and f"{name}.weight" in int8.scales:
                module.weight_scale = int8.scales.pop(f"{name}.weight")
            module.use_kernel(kernels[module.weight_scale is not None])  # one matrix at a time, as above
    model.init_buffers(device)
    model.linear_kernels = sorted({m.kernel.name for m in model.modules() if isinstance(m, LinearProduct)})
    return model.eval()


class Int8Finish:
    """`read_tensors`' finish step: each quantized product, as soon as it is read, to int8 values (returned, for
    the model to load) and its groups' float16 scales and minima (kept in `scales` for `build_shard` to attach)."""

    def __init__(self, model: Transformer) -> None:
        self.names = int8_products(model)
        self.scales: dict[str, torch.Tensor] = {}

    def __call__(self, target: str, reads: list[TensorRead], loaded: torch.Tensor) -> torch.Tensor:
        if target not in self.names:
            return loaded
        _edge_groups(target, reads)
        q, self.scales[target] = quantize_groups(loaded)
        return q


def _edge_groups(target: str, reads: list[TensorRead]) -> None:
    """Log when a tensor-parallel slice of some inputs (a row-parallel product's) does not hold whole int8 groups.
    Groups start at the slice's first input, so such a slice's edge groups are not the unsliced product's: its
    numbers differ from other degrees' by int8 rounding. Slices of whole groups (head dims and FFN splits that are
    multiples of `INT8_GROUP`, as in Llama-family models) hold exactly the numbers of every other degree."""
    for r in reads:
        if r.index is None or len(r.index) < 2:
            continue
        start, stop, _ = r.index[1].indices(r.full_shape[1])
        if start % INT8_GROUP or (stop != r.full_shape[1] and stop % INT8_GROUP):
            note = "this slice's edge groups differ from other tensor-parallel degrees'"
            log.warning("int8_groups_split", product=target, inputs=[start, stop], of=r.full_shape[1],
                        group=INT8_GROUP, note=note)  # fmt: skip
            return
