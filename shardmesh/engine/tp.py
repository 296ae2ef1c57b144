"""Tensor parallelism as a transform: `apply_tp(model, group)` swaps a stage's layers for sharded ones.

Run it on the model while it is still on the `meta` device: the sharded modules are created with
their local shapes and record which slice of each checkpoint tensor they hold (`checkpoint_index`),
so the loader reads only those bytes. Every slice is contiguous, so `safe_open(...).get_slice(name)`
reads it without touching the rest of the tensor.

Per decoder layer (Megatron's scheme, one all-reduce per attention and one per MLP):
  attention  q/k/v: column-parallel by heads     o_proj: row-parallel, then all-reduce
  MLP        gate/up: column-parallel by columns down_proj: row-parallel, then all-reduce
At the ends of the model the vocabulary is split: the embedding looks up only its rows and the
partial results are all-reduced; the LM head computes its share of logits and they are all-gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.heads import HeadSplit, TensorParallelError
from shardmesh.engine.groups import Collective
from shardmesh.engine.linear import linear
from shardmesh.engine.model import Attention, Transformer

Index = tuple[slice, ...]


def _rows(start: int, count: int, ndim: int) -> Index:
    return (slice(start, start + count),) + (slice(None),) * (ndim - 1)


class ColumnParallelLinear(nn.Module):
    """Y_i = X A_i + b_i: A (in, out) is split along `out`; each rank produces its own output columns.

    The checkpoint stores A transposed, as (out, in), so our columns are contiguous *rows* of it.
    No communication: the next layer consumes the split output as is.
    """

    def __init__(self, src: nn.Linear, out_start: int, out_count: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_count, src.in_features, device="meta"), requires_grad=False)
        self.bias = None
        self.checkpoint_index: dict[str, Index] = {"weight": _rows(out_start, out_count, 2)}
        if src.bias is not None:
            self.bias = nn.Parameter(torch.empty(out_count, device="meta"), requires_grad=False)
            self.checkpoint_index["bias"] = _rows(out_start, out_count, 1)

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = sum_i X_i A_i + b: A (in, out) is split along `in`, matching a column-split input X_i.

    Each rank computes a partial sum; the all-reduce over the group completes it. The bias is
    added once, after the reduction, so it is not counted `size` times.
    """

    def __init__(self, src: nn.Linear, in_start: int, in_count: int, group: Collective) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(src.out_features, in_count, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, Index] = {"weight": (slice(None), slice(in_start, in_start + in_count))}
        self.bias = None
        if src.bias is not None:
            self.bias = nn.Parameter(torch.empty(src.out_features, device="meta"), requires_grad=False)
            self.checkpoint_index["bias"] = (slice(None),)

    def forward(self, x: Tensor) -> Tensor:
        y = self.group.all_reduce(linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


def _vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """Equal chunks of ceil(vocab / size); the last may be short (or empty) when size does not divide."""
    chunk = -(-vocab // size)
    start = min(rank * chunk, vocab)
    return start, min(start + chunk, vocab)


class VocabParallelEmbedding(nn.Module):
    """E[ids] = sum_i E_i[ids]: rank i holds vocab rows [start_i, end_i) and contributes zeros elsewhere."""

    def __init__(self, vocab: int, dim: int, group: Collective) -> None:
        super().__init__()
        self.group = group
        self.start, self.end = _vocab_range(vocab, group.rank, group.size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, Index] = {"weight": _rows(self.start, self.end - self.start, 2)}

    def forward(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    """logits = [X W_0^T, ..., X W_{n-1}^T]: each rank scores its vocab chunk; all-gather joins them.

    Chunks are padded to equal size for the gather, and the padding is cut off afterwards.
    """

    def __init__(self, vocab: int, dim: int, group: Collective) -> None:
        super().__init__()
        self.group, self.vocab = group, vocab
        self.start, self.end = _vocab_range(vocab, group.rank, group.size)
        self.chunk = -(-vocab // group.size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, Index] = {"weight": _rows(self.start, self.end - self.start, 2)}

    def forward(self, x: Tensor) -> Tensor:
        local = linear(x, self.weight)
        pad = self.chunk - local.shape[-1]
        if pad:
            local = F.pad(local, (0, pad))
        return self.group.all_gather(local)[..., : self.vocab]


def _shard_attention(attn: Attention, split: HeadSplit, group: Collective) -> None:
    hd = attn.head_dim
    attn.q_proj = ColumnParallelLinear(attn.q_proj, split.q_start * hd, split.q_count * hd)
    attn.k_proj = ColumnParallelLinear(attn.k_proj, split.kv_start * hd, split.kv_count * hd)
    attn.v_proj = ColumnParallelLinear(attn.v_proj, split.kv_start * hd, split.kv_count * hd)
    attn.o_proj = RowParallelLinear(attn.o_proj, split.q_start * hd, split.q_count * hd, group)
    attn.n_heads, attn.n_kv_heads = split.q_count, split.kv_count


def apply_tp(model: Transformer, group: Collective) -> Transformer:
    """Shard `model` (on the meta device) for rank `group.rank` of a tensor-parallel group, in place."""
    if group.size == 1:
        return model
    cfg = model.cfg
    split = HeadSplit.of(cfg, group.rank, group.size)
    if cfg.intermediate_size % group.size:
        raise TensorParallelError(
            f"tensor parallel degree {group.size} must divide intermediate_size={cfg.intermediate_size}"
        )
    ffn = cfg.intermediate_size // group.size
    ffn_start = group.rank * ffn
    for layer in model.model.layers.values():
        _shard_attention(layer.self_attn, split, group)
        mlp = layer.mlp
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, ffn_start, ffn)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, ffn_start, ffn)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, ffn_start, ffn, group)
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(cfg.vocab_size, cfg.hidden_size, group)
    return model


def bind_group(model: Transformer, group: Collective) -> None:
    """Point every sharded module at `group`: the process group of a (new) topology, same shard."""
    for module in model.modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)):
            if (module.group.rank, module.group.size) != (group.rank, group.size):
                raise ValueError(f"shard was built for tp rank {module.group.rank} of {module.group.size}")
            module.group = group


def checkpoint_index(model: nn.Module, param_name: str) -> Index | None:
    """The slice of the checkpoint tensor that `param_name` holds, or None for the whole tensor."""
    module_path, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    return getattr(module, "checkpoint_index", {}).get(leaf)
