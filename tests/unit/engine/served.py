"""What a loaded shard serves, checkpoint block by checkpoint block, for comparing against the checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from shardmesh.core.config import ModelConfig
from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import LinearProduct
from shardmesh.engine.loader import meta_shard
from shardmesh.models.checkpoint import TensorRead


def served_blocks(model: nn.Module, spec: ShardSpec) -> list[tuple[TensorRead, torch.Tensor]]:
    """Each read that filled `model` (built for `spec`) with the values the model multiplies by for it:
    the parameter as a plain (out, in) tensor whatever its kernel's layout, cut to the read's rows (a
    stacked qkv gives its q, k and v slices back)."""
    cfg: ModelConfig = model.cfg
    _, reads = meta_shard(cfg, spec, UnboundGroup(spec.tp_rank, spec.tp_size), None)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    out = []
    for r in reads:
        path, _, leaf = r.target.rpartition(".")
        module, p = modules[path], params[r.target]
        product = isinstance(module, LinearProduct) and leaf == "weight"
        values = module.kernel.dense(p, module.weight_scale) if product else p
        out.append((r, values[r.row : r.row + r.shape[0]]))
    return out
