"""Decode steps of a CPU shard in compiled code: two calls per decoder layer instead of ~70.

On a CPU a decode step's weights stream in ~15-20 ms for SmolLM2, and eager PyTorch adds ~12 ms of its own: each
of a layer's ~70 small operations (norms, RoPE, the KV write, attention's reshapes, SwiGLU, residuals) costs a few
microseconds of dispatch, as much as the layer's products together. This runner computes each half of a layer
(`cpu_kernels.attention_block`, `mlp_block`) in one call over the same weights, KV cache and RoPE tables as the
eager model, which still runs every step this one does not accept (prompts, paged caches, other devices). It is the
CPU's counterpart of `cuda_graph`: the model stays one readable file and this is another way to execute it.

Tensor parallelism stays where it is: each half returns its partial sum and the row-parallel product's group
all-reduces it, then adds the bias and the residual, exactly as `tp.RowParallelLinear` and `DecoderLayer` do.

Eligible: a CPU shard whose decoder products all use the blocked kernels (`linear.BlockedCpuKernel`: float32 or
bfloat16; its subclass `BlockedInt8Kernel`: int8 weights of a float32 shard; kernels built, none streamed from
disk), the slot KV cache, a step of one-token segments (decode), logits of each sequence's last token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shardmesh.engine import cpu_kernels
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.kv_cache import AnyKVCache, KVCache
from shardmesh.engine.linear import BlockedCpuKernel, LinearProduct
from shardmesh.engine.model import DecoderLayer, Transformer
from shardmesh.engine.tp import RowParallelLinear


def cpu_decode(model: Transformer, cache: AnyKVCache, device: torch.device) -> CpuDecode | None:
    """The runner for a shard whose decode steps it can compute (see the module docstring), else None."""
    if device.type != "cpu" or not isinstance(cache, KVCache) or model.dtype not in (torch.float32, torch.bfloat16):
        return None
    products = [m for layer in model.model.layers.values() for m in layer.modules() if isinstance(m, LinearProduct)]
    if not products or not all(isinstance(m.kernel, BlockedCpuKernel) for m in products):
        return None
    return CpuDecode(model, cache)


class CpuDecode:
    """Runs the decode steps of one CPU shard through `cpu_kernels`' layer halves."""

    def __init__(self, model: Transformer, cache: KVCache) -> None:
        self.model, self.cache = model, cache
        self.ext = cpu_kernels.module()
        self._layers: list[_LayerCalls] = []
        self._for: object = None  # the cache tensor `_layers` holds views of

    def accepts(self, batch: BatchLayout, all_logits: bool) -> bool:
        """A step of one-token segments only, as a slot layout, last-token logits."""
        return not all_logits and batch.block_size == 0 and all(s.length == 1 for s in batch.segments)

    @torch.inference_mode()
    def run(self, batch: BatchLayout, x: Tensor) -> Tensor:
        """The shard's output for `batch` (which `accepts`): (n, vocab) float32 logits or (n, hidden) activations."""
        model, ext = self.model, self.ext
        cos, sin = model.rope_cos, model.rope_sin
        assert cos is not None and sin is not None, "call init_buffers() first"
        self.cache.check(batch)
        slots, positions = batch.kv_index
        if model.model.embed_tokens is not None:
            x = model.model.embed_tokens(x)
        for c in self._calls():
            out = ext.attention_block(x, *c.attention, slots, positions, cos, sin, *c.heads)
            x = _reduce(c.o, x, out) if c.o is not None else out
            out = ext.mlp_block(x, *c.mlp)
            x = _reduce(c.down, x, out) if c.down is not None else out
        if model.lm_head is None:
            return x
        assert model.model.norm is not None
        return model.lm_head(model.model.norm(x)).float()  # one row per sequence: each is its last token

    def _calls(self) -> list[_LayerCalls]:
        """Each layer's arguments that stay the same from step to step, gathered once (per cache tensor): looking
        them up through the modules' attributes took ~0.5 ms of a ~12 ms step (SmolLM2, bfloat16)."""
        if self._for is not self.cache.data:
            self._layers = [_LayerCalls.of(layer, self.cache.keys(i), self.cache.values(i))
                            for i, layer in enumerate(self.model.model.layers.values())]  # fmt: skip
            self._for = self.cache.data
        return self._layers


@dataclass(frozen=True)
class _LayerCalls:
    """One decoder layer's constant arguments to `attention_block` (before and after the step's slots and positions)
    and `mlp_block`, and its row-parallel products when tensor-parallel (their group all-reduces each half's partial
    sum, looked up at each step so that a re-bound group is used), None otherwise."""

    attention: tuple[Any, ...]
    heads: tuple[Any, ...]
    mlp: tuple[Any, ...]
    o: RowParallelLinear | None
    down: RowParallelLinear | None

    @classmethod
    def of(cls, layer: DecoderLayer, keys: Tensor, values: Tensor) -> _LayerCalls:
        attn, norm, mlp, post = layer.self_attn, layer.input_layernorm, layer.mlp, layer.post_attention_layernorm
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        o_sharded, down_sharded = isinstance(o, RowParallelLinear), isinstance(down, RowParallelLinear)
        return cls(
            (norm.weight, norm.eps, qkv.weight, qkv.bias, qkv.weight_scale, o.weight, None if o_sharded else o.bias,
             o.weight_scale, keys, values),
            (attn.n_heads, attn.n_kv_heads, not o_sharded),
            (post.weight, post.eps, gate_up.weight, gate_up.bias, gate_up.weight_scale, down.weight,
             None if down_sharded else down.bias, down.weight_scale, not down_sharded),
            o if o_sharded else None, down if down_sharded else None,
        )  # fmt: skip


def _reduce(product: RowParallelLinear, x: Tensor, partial: Tensor) -> Tensor:
    """x + all_reduce(partial) + bias: a row-parallel product's end and the residual, as the eager layer adds them."""
    y = product.group.all_reduce(partial)
    if product.bias is not None:
        y = y + product.bias
    return x + y
