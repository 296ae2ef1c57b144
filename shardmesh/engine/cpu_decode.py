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

    def accepts(self, batch: BatchLayout, all_logits: bool) -> bool:
        """A step of one-token segments only, as a slot layout, last-token logits."""
        return not all_logits and batch.block_size == 0 and all(s.length == 1 for s in batch.segments)

    @torch.inference_mode()
    def run(self, batch: BatchLayout, x: Tensor) -> Tensor:
        """The shard's output for `batch` (which `accepts`): (n, vocab) float32 logits or (n, hidden) activations."""
        model = self.model
        assert model.rope_cos is not None and model.rope_sin is not None, "call init_buffers() first"
        self.cache.check(batch)
        slots, positions = batch.kv_index
        if model.model.embed_tokens is not None:
            x = model.model.embed_tokens(x)
        for index, layer in enumerate(model.model.layers.values()):
            x = self._attention(layer, index, x, slots, positions)
            x = self._mlp(layer, x)
        if model.lm_head is None:
            return x
        assert model.model.norm is not None
        return model.lm_head(model.model.norm(x)).float()  # one row per sequence: each is its last token

    def _attention(self, layer: DecoderLayer, index: int, x: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
        attn, norm = layer.self_attn, layer.input_layernorm
        qkv, o = attn.qkv_proj, attn.o_proj
        sharded = isinstance(o, RowParallelLinear)
        out = self.ext.attention_block(
            x, norm.weight, norm.eps, qkv.weight, qkv.bias, qkv.weight_scale, o.weight,
            None if sharded else o.bias, o.weight_scale, self.cache.keys(index), self.cache.values(index), slots,
            positions, self.model.rope_cos, self.model.rope_sin, attn.n_heads, attn.n_kv_heads, not sharded,
        )  # fmt: skip
        return _reduce(o, x, out) if sharded else out

    def _mlp(self, layer: DecoderLayer, x: Tensor) -> Tensor:
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        sharded = isinstance(down, RowParallelLinear)
        out = self.ext.mlp_block(
            x, norm.weight, norm.eps, gate_up.weight, gate_up.bias, gate_up.weight_scale,
            down.weight, None if sharded else down.bias, down.weight_scale, not sharded,
        )  # fmt: skip
        return _reduce(down, x, out) if sharded else out


def _reduce(product: RowParallelLinear, x: Tensor, partial: Tensor) -> Tensor:
    """x + all_reduce(partial) + bias: a row-parallel product's end and the residual, as the eager layer adds them."""
    y = product.group.all_reduce(partial)
    if product.bias is not None:
        y = y + product.bias
    return x + y
