"""Tensor parallelism as a transform: `apply_tp(model, group)` swaps a stage's layers for sharded ones.

Run it on the model while it is still on the `meta` device: the sharded modules are created with
their local shapes and record which slice of each checkpoint tensor they hold (`checkpoint_index`),
so the loader reads only those bytes. Every slice is contiguous, so `safe_open(...).get_slice(name)`
reads it without touching the rest of the tensor.

Per decoder layer (Megatron's scheme, one all-reduce per attention and one per MLP; the MLP columns and the
vocabulary in proportion to a `TpSplit` where one is given, `shardmesh.core.heads`):
  attention  qkv: column-parallel by heads       o_proj: row-parallel, then all-reduce
  MLP        gate_up: column-parallel by columns down_proj: row-parallel, then all-reduce
A stacked product is sliced one block at a time: rank r's qkv is [q_r; k_r; v_r] (its own heads' q, k
and v, in the order the model splits them) and its gate_up is [gate_r; up_r], paired column for column.
At the ends of the model the vocabulary is split: the embedding looks up only its rows and the
partial results are all-reduced; the LM head computes its share of logits and they are all-gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.heads import HeadSplit, TpSplit, mlp_range, vocab_range
from shardmesh.engine.groups import Collective
from shardmesh.engine.linear import Linear, LinearProduct
from shardmesh.engine.model import Attention, Transformer

Index = tuple[slice, ...]


def _rows(start: int, count: int, ndim: int) -> Index:
    return (slice(start, start + count),) + (slice(None),) * (ndim - 1)


class ColumnParallelLinear(LinearProduct):
    """Y_i = X A_i + b_i: A (in, out) is split along `out`; each rank produces its own output columns.

    The checkpoint stores A transposed, as (out, in), so our columns are contiguous *rows* of it. A
    stacked A = [A_0 | A_1 | ...] (blocks of `src`) is split block by block, `ranges[j]` = (start, count)
    of block j's columns: A_i = [A_0,i | A_1,i | ...]. No communication: the next layer consumes the
    split output as is.
    """

    def __init__(self, src: Linear, ranges: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        if len(ranges) != max(1, len(src.blocks)):
            raise ValueError(f"{len(ranges)} column ranges for a product of {len(src.blocks)} blocks")
        out = sum(count for _, count in ranges)
        self.weight = nn.Parameter(torch.empty(out, src.in_features, device="meta"), requires_grad=False)
        self.bias = None
        self.checkpoint_index: dict[str, tuple[Index, ...]] = {"weight": tuple(_rows(s, n, 2) for s, n in ranges)}
        if src.bias is not None:
            self.bias = nn.Parameter(torch.empty(out, device="meta"), requires_grad=False)
            self.checkpoint_index["bias"] = tuple(_rows(s, n, 1) for s, n in ranges)

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, self.bias)


class RowParallelLinear(LinearProduct):
    """Y = sum_i X_i A_i + b: A (in, out) is split along `in`, matching a column-split input X_i.

    Each rank computes a partial sum; the all-reduce over the group completes it. The bias is
    added once, after the reduction, so it is not counted `size` times.
    """

    def __init__(self, src: Linear, in_start: int, in_count: int, group: Collective) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(src.out_features, in_count, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, tuple[Index, ...]] = {
            "weight": ((slice(None), slice(in_start, in_start + in_count)),)
        }
        self.bias = None
        if src.bias is not None:
            self.bias = nn.Parameter(torch.empty(src.out_features, device="meta"), requires_grad=False)
            self.checkpoint_index["bias"] = ((slice(None),),)

    def forward(self, x: Tensor) -> Tensor:
        y = self.group.all_reduce(self.product(x))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """E[ids] = sum_i E_i[ids]: rank i holds vocab rows [start_i, end_i) and contributes zeros elsewhere."""

    def __init__(self, vocab: int, dim: int, group: Collective, split: TpSplit = ()) -> None:
        super().__init__()
        self.group = group
        self.start, self.end = vocab_range(vocab, group.rank, group.size, split)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, tuple[Index, ...]] = {"weight": (_rows(self.start, self.end - self.start, 2),)}

    def forward(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(out)


class VocabParallelHead(LinearProduct):
    """logits = [X W_0^T, ..., X W_{n-1}^T]: each rank scores its vocab chunk; all-gather joins them.

    Chunks are padded to the largest one's size for the gather, and the padding is cut off afterwards (after the
    last chunk only, when the chunks are even; after each, when a `TpSplit` makes them uneven).
    """

    def __init__(self, vocab: int, dim: int, group: Collective, split: TpSplit = ()) -> None:
        super().__init__()
        self.group, self.vocab = group, vocab
        self.start, self.end = vocab_range(vocab, group.rank, group.size, split)
        self.sizes = [e - s for s, e in (vocab_range(vocab, r, group.size, split) for r in range(group.size))]
        self.chunk = max(self.sizes)
        self.even = all(n == self.chunk for n in self.sizes[:-1])  # only the last chunk may be short
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, device="meta"), requires_grad=False)
        self.checkpoint_index: dict[str, tuple[Index, ...]] = {"weight": (_rows(self.start, self.end - self.start, 2),)}

    def forward(self, x: Tensor) -> Tensor:
        local = self.product(x)
        pad = self.chunk - local.shape[-1]
        if pad:
            local = F.pad(local, (0, pad))
        gathered = self.group.all_gather(local)
        if self.even:
            return gathered[..., : self.vocab]
        return torch.cat([gathered[..., r * self.chunk : r * self.chunk + n] for r, n in enumerate(self.sizes)], -1)


def _shard_attention(attn: Attention, split: HeadSplit, group: Collective) -> None:
    hd = attn.head_dim
    q, kv = (split.q_start * hd, split.q_count * hd), (split.kv_start * hd, split.kv_count * hd)
    attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, (q, kv, kv))
    attn.o_proj = RowParallelLinear(attn.o_proj, split.q_start * hd, split.q_count * hd, group)
    attn.n_heads, attn.n_kv_heads = split.q_count, split.kv_count


def apply_tp(model: Transformer, group: Collective, split: TpSplit = ()) -> Transformer:
    """Shard `model` (on the meta device) for rank `group.rank` of a tensor-parallel group, in place: the heads
    evenly, the MLP columns and the vocabulary by `split`'s shares (evenly when it is empty)."""
    if group.size == 1:
        return model
    cfg = model.cfg
    heads = HeadSplit.of(cfg, group.rank, group.size)
    ffn_start, ffn_end = mlp_range(cfg, group.rank, group.size, split)
    ffn = ffn_end - ffn_start
    for layer in model.model.layers.values():
        _shard_attention(layer.self_attn, heads, group)
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, ((ffn_start, ffn), (ffn_start, ffn)))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, ffn_start, ffn, group)
    if model.model.embed_tokens is not None:
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group, split)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(cfg.vocab_size, cfg.hidden_size, group, split)
    return model


def bind_group(model: Transformer, group: Collective) -> None:
    """Point every sharded module at `group`: the process group of a (new) topology, same shard."""
    for module in model.modules():
        if isinstance(module, (RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)):
            if (module.group.rank, module.group.size) != (group.rank, group.size):
                raise ValueError(f"shard was built for tp rank {module.group.rank} of {module.group.size}")
            module.group = group


def checkpoint_index(model: nn.Module, param_name: str) -> tuple[Index, ...] | None:
    """The slice of each checkpoint tensor that `param_name` holds, one per block in row order (one for a
    parameter that is a single tensor), or None when it holds whole tensors."""
    module_path, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    return getattr(module, "checkpoint_index", {}).get(leaf)
