"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2) as one readable, parallelism-agnostic file.

A `Transformer` holds one pipeline stage: a half-open range of decoder layers, plus the embedding if it
is the first stage and the final norm and LM head if it is the last. Module paths mirror the Hugging
Face checkpoint (`model.layers.7.self_attn.o_proj.weight`), so a parameter's name *is* its tensor name
in the safetensors files, with two exceptions: q/k/v are one product, `qkv_proj`, and gate/up are one,
`gate_up_proj`, whose `blocks` name the checkpoint tensors stacked in them. Tensor parallelism is not
here: `tp.apply_tp` swaps the linear layers for sharded ones and tells each attention module how many
heads it now owns.

Why stacked: a decode step multiplies a handful of rows by every weight matrix, so each product costs its
weight bytes plus a fixed price (dispatch, an OpenMP fork and join, oneDNN's primitive lookup). q, k and
v read the same input, as do gate and up: one product each turns 7 products per layer into 4 (measured,
SmolLM2's 30 layers, one row, packed fp32, 2 threads: 35.1 -> 32.0 ms of products, 1 thread 21.1 -> 19.1
ms; vLLM's QKVParallelLinear and gpt-fast's `wqkv` do the same).

Tokens are packed: one step carries several sequences back to back as a (T, hidden) tensor, laid out by
a `batch.BatchLayout`; keys and values go to a `kv_cache.KVCache` (by slot) or `kv_cache.PagedKVCache` (by
block), which write and read them for `Attention`: the layout is the cache's, not a branch here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardmesh.core.config import ModelConfig, RopeScaling
from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.kv_cache import AnyKVCache, KVCache, PagedKVCache
from shardmesh.engine.linear import Block, Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 whatever the activation dtype, as the reference implementation does.
        # One fused kernel where PyTorch has one (CUDA: 8 kernels -> 4 per norm with the casts; the same numbers).
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies (head_dim // 2,), with Llama-3.1's wavelength-dependent scaling if asked."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[Tensor, Tensor]:
    """cos and sin, each (max_len, head_dim), in float32."""
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (T, heads, head_dim); cos, sin: (T, 1, head_dim)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_index: int) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        # Heads this module computes; tp.apply_tp lowers them to the local share.
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.num_kv_heads
        self.cache_index = cache_index
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        blocks = (Block("q_proj", q_out), Block("k_proj", kv_out), Block("v_proj", kv_out))
        self.qkv_proj = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias, blocks=blocks)
        self.o_proj = Linear(q_out, cfg.hidden_size, bias=cfg.o_proj_bias)

    def forward(self, x: Tensor, batch: BatchLayout, cache: AnyKVCache, cos: Tensor, sin: Tensor) -> Tensor:
        T = x.shape[0]
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qk, v = self.qkv_proj(x).split((q_out + kv_out, kv_out), dim=-1)  # (T, q_out + kv_out), (T, kv_out)
        # Queries and keys rotated together: one pass of rope's kernels, not two (a decode step's kernels are
        # mostly this small; on a GPU each costs a few microseconds whatever its size).
        qk = apply_rope(qk.view(T, self.n_heads + self.n_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split((self.n_heads, self.n_kv_heads), dim=1)  # (T, h, hd), (T, kvh, hd)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        # Every new key first, then the reads: a token sees positions up to its own, all written by now.
        cache.write(self.cache_index, batch, k, v)
        out = torch.empty_like(q)
        if batch.decode is not None:
            rows = batch.decode.rows
            out[rows] = cache.attend_decode(self.cache_index, q[rows], batch.decode)
        for i, (row, seg) in enumerate(batch.looped):
            rows = slice(row, row + seg.length)
            keys, values = cache.history(self.cache_index, batch, i)
            out[rows] = self._attend(q[rows].transpose(0, 1), keys, values, seg)
        return self.o_proj(out.view(T, self.n_heads * self.head_dim))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, seg: Segment) -> Tensor:
        """q: (h, n, hd) new queries; k, v: (kvh, start + n, hd) everything cached so far → (n, h, hd).

        Grouped-query attention without copying keys: the g = h / kvh query heads that share a kv
        head are folded into the query length, q → (kvh, g·n, hd), so each kv head is read once and
        SDPA keeps its fused kernel (its own GQA option falls back to a path that copies k and v).
        """
        h, n, hd = q.shape
        g = h // self.n_kv_heads
        q = q.reshape(self.n_kv_heads, g * n, hd)  # query heads of one group are adjacent
        if n == 1:
            mask = None  # one new token sees the whole cache
        else:
            # Row i of a group sees the cache before this segment plus new tokens up to i.
            total = seg.start + n
            causal = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=seg.start)
            mask = causal.repeat(g, 1)  # (g·n, total): the same rule for every head of the group
        # A leading batch dim of 1: with 4-D inputs CPU SDPA takes its fused (flash) kernel, 2x faster here.
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]  # (kvh, g·n, hd)
        return o.reshape(h, n, hd).transpose(0, 1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        blocks = (Block("gate_proj", inter), Block("up_proj", inter))
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias, blocks=blocks)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (T, inter) each, also when sharded: [gate_r; up_r]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cache_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, batch: BatchLayout, cache: AnyKVCache, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embedding(cfg: ModelConfig) -> nn.Embedding:
    # `_weight` skips the random init, which on `meta` imports torch's dynamo stack (~70 MB, ~1.3 s).
    return nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))


class Body(nn.Module):
    """Named `model` inside `Transformer`, so that paths match `model.layers.N...` in checkpoints."""

    def __init__(self, cfg: ModelConfig, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = _embedding(cfg) if first else None
        # Keyed by the global layer index; the value's position is its slot in this stage's KV cache.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i - layers.start) for i in layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None


class Transformer(nn.Module):
    """One pipeline stage: layers [start, end) of the model, plus embedding / head at the ends."""

    def __init__(self, cfg: ModelConfig, layers: range, max_len: int | None = None) -> None:
        super().__init__()
        if not (0 <= layers.start < layers.stop <= cfg.num_layers) or layers.step != 1:
            raise ValueError(f"layer range [{layers.start}, {layers.stop}) is not within [0, {cfg.num_layers})")
        self.cfg = cfg
        self.layer_range = layers
        self.is_first = layers.start == 0
        self.is_last = layers.stop == cfg.num_layers
        self.model = Body(cfg, layers, self.is_first, self.is_last)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last else None
        self.max_len = max_len or cfg.max_context
        # Rope tables are derived data, rebuilt on the real device after loading (see `init_buffers`).
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None
        self.linear_kernels: list[str] = []  # the names of the kernels the loader chose for the products
        self.streamer: Any = None  # when layers stream (a budget): `offload.LayerStreamer`, `host_offload`'s on CUDA

    @property
    def dtype(self) -> torch.dtype:
        """The serving dtype: activations, norms, embedding (quantized products hold int8 weights)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def init_buffers(self, device: torch.device | str) -> None:
        self.rope_cos, self.rope_sin = (t.to(device) for t in rope_tables(self.cfg, self.max_len))

    def forward(self, inputs: Tensor, batch: BatchLayout, cache: AnyKVCache, all_logits: bool = False) -> Tensor:
        """inputs: token ids (T,) on the first stage, hidden states (T, hidden) elsewhere.

        Returns hidden states (T, hidden) for the next stage, or on the last stage float32 logits:
        (B, vocab) for each sequence's last token, or (T, vocab) for every token with `all_logits`.
        """
        assert self.rope_cos is not None and self.rope_sin is not None, "call init_buffers() first"
        cache.check(batch)
        x = self.model.embed_tokens(inputs) if self.model.embed_tokens is not None else inputs
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # (T, 1, hd)
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        for layer in self.model.layers.values():
            x = layer(x, batch, cache, cos, sin)
        if self.lm_head is None:
            return x
        assert self.model.norm is not None
        if not all_logits:
            x = x[batch.last_index]
        return self.lm_head(self.model.norm(x)).float()

    def make_cache(self, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """A slot cache: `num_slots` sequences of up to `max_len` positions each."""
        return KVCache(len(self.model.layers), num_slots, self._kv_heads, self.max_len, self.cfg.head_dim, dtype,
                       device)  # fmt: skip

    def make_paged_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype,
                         device: torch.device | str) -> PagedKVCache:  # fmt: skip
        """A paged cache: `num_blocks` blocks of `block_size` positions, shared through block tables; layouts for it
        are built with `BatchLayout.build(..., block_size=block_size)`."""
        return PagedKVCache(len(self.model.layers), num_blocks, self._kv_heads, block_size, self.cfg.head_dim, dtype,
                            device)  # fmt: skip

    @property
    def _kv_heads(self) -> int:
        """kv heads this shard holds (its share under tensor parallelism)."""
        return next(iter(self.model.layers.values())).self_attn.n_kv_heads
