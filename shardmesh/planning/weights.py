"""What one tensor rank of a shard holds, from config.json alone: every checkpoint tensor it reads, the
slice of it, and the parameter the slice fills. No torch and no weights: the planner counts bytes with
this, and `memory.load_model` checks a checkpoint's headers against it.

Per decoder layer (checkpoint names, below ``model.layers.N.``), on rank r of tp, with H = hidden,
d = head_dim, q and kv = the rank's query and kv heads (`HeadSplit`), F = its intermediate columns
(`mlp_range`), V = its vocabulary rows (`vocab_range`):

  input_layernorm, post_attention_layernorm   (H,) each, whole on every rank
  self_attn.{q,k,v}_proj                      (q·d, H), (kv·d, H), (kv·d, H)   stacked: self_attn.qkv_proj
                                              (+ biases (q·d,), (kv·d,) ×2 with attention_bias)
  self_attn.o_proj                            (H, q·d)   (+ bias (H,), whole, with o_proj_bias)
  mlp.{gate,up}_proj                          (F, H) ×2  stacked: mlp.gate_up_proj  (+ biases (F,) ×2)
  mlp.down_proj                               (H, F)     (+ bias (H,), whole)

The first stage adds model.embed_tokens (V, H); the last adds model.norm (H,) and lm_head (V, H), read
from model.embed_tokens when the embeddings are tied. At tp = 1 every slice is its whole tensor.
This is the layout `shardmesh.engine.loader.meta_shard` builds; tests/unit/planning/test_weights.py
compares the two for every model family, tensor degree and rank.

The matrix products of a layer (qkv_proj, o_proj, gate_up_proj, down_proj: `Part.products`) and the LM head are what
`Quantization.INT8` stores as int8 (`shardmesh.engine.linear.int8_products`); a layer's are what a memory budget
streams (`shardmesh.engine.offload`); the norms, biases and the embedding stay in the serving dtype.
A streamed product maps its reads' bytes in the checkpoint from first to last (`Part.spans`): a slice of whole
rows spans its own elements, a slice of some columns (o_proj, down_proj at tp > 1) all rows but the last in full;
an int8 shard streams them from the int8 copy, values and scales apart (`Part.int8_spans`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import INT8_GROUP, DType, Quantization
from shardmesh.core.heads import HeadSplit, TpSplit, mlp_range, vocab_range


@dataclass(frozen=True)
class TensorSlice:
    """The part of checkpoint tensor `source` (shape `full`) one rank reads (shape `local`) into `target`."""

    source: str
    full: tuple[int, ...]
    local: tuple[int, ...]
    target: str  # the parameter it fills; q/k/v stack into one, as do gate/up

    @property
    def numel(self) -> int:
        return math.prod(self.local)


def _whole(name: str, shape: tuple[int, ...]) -> TensorSlice:
    return TensorSlice(name, shape, shape, name)


def _embedding(cfg: ModelConfig, tp: int, rank: int, split: TpSplit = ()) -> list[TensorSlice]:
    start, end = vocab_range(cfg.vocab_size, rank, tp, split)
    name = "model.embed_tokens.weight"
    return [TensorSlice(name, (cfg.vocab_size, cfg.hidden_size), (end - start, cfg.hidden_size), name)]


def _layer(cfg: ModelConfig, index: int, tp: int, rank: int, split: TpSplit = ()) -> list[TensorSlice]:
    h, d = cfg.hidden_size, cfg.head_dim
    heads = HeadSplit.of(cfg, rank, tp)
    start, end = mlp_range(cfg, rank, tp, split)
    q, kv, f = heads.q_count * d, heads.kv_count * d, end - start
    attn, mlp = f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
    norms = ("input_layernorm", "post_attention_layernorm")
    out = [_whole(f"model.layers.{index}.{norm}.weight", (h,)) for norm in norms]
    for proj, full, local in (("q_proj", cfg.num_heads * d, q), ("k_proj", cfg.num_kv_heads * d, kv),
                              ("v_proj", cfg.num_kv_heads * d, kv)):  # fmt: skip
        out.append(TensorSlice(f"{attn}{proj}.weight", (full, h), (local, h), f"{attn}qkv_proj.weight"))
        if cfg.attention_bias:
            out.append(TensorSlice(f"{attn}{proj}.bias", (full,), (local,), f"{attn}qkv_proj.bias"))
    out.append(TensorSlice(f"{attn}o_proj.weight", (h, cfg.num_heads * d), (h, q), f"{attn}o_proj.weight"))
    if cfg.o_proj_bias:
        out.append(_whole(f"{attn}o_proj.bias", (h,)))  # added once, after the all-reduce
    for proj in ("gate_proj", "up_proj"):
        out.append(TensorSlice(f"{mlp}{proj}.weight", (cfg.intermediate_size, h), (f, h), f"{mlp}gate_up_proj.weight"))
        if cfg.mlp_bias:
            out.append(TensorSlice(f"{mlp}{proj}.bias", (cfg.intermediate_size,), (f,), f"{mlp}gate_up_proj.bias"))
    out.append(TensorSlice(f"{mlp}down_proj.weight", (h, cfg.intermediate_size), (h, f), f"{mlp}down_proj.weight"))
    if cfg.mlp_bias:
        out.append(_whole(f"{mlp}down_proj.bias", (h,)))
    return out


def _head(cfg: ModelConfig, tp: int, rank: int, split: TpSplit = ()) -> list[TensorSlice]:
    start, end = vocab_range(cfg.vocab_size, rank, tp, split)
    # Tied embeddings: the head reuses the embedding matrix, which checkpoints store once.
    source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = TensorSlice(source, (cfg.vocab_size, cfg.hidden_size), (end - start, cfg.hidden_size), "lm_head.weight")
    return [_whole("model.norm.weight", (cfg.hidden_size,)), head]


def shard_slices(cfg: ModelConfig, layers: range, tp: int, rank: int, split: TpSplit = ()) -> list[TensorSlice]:
    """Everything rank `rank` of `tp` reads for layers [start, stop), with the embedding on the first stage
    and the final norm and LM head on the last (the MLP and the vocabulary by `split`'s shares, evenly when it is
    empty). TensorParallelError for a degree the model cannot split by."""
    out = _embedding(cfg, tp, rank, split) if layers.start == 0 else []
    for i in layers:
        out += _layer(cfg, i, tp, rank, split)
    return out + (_head(cfg, tp, rank, split) if layers.stop == cfg.num_layers else [])


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, with its shape."""
    return {s.source: s.full for s in shard_slices(cfg, range(cfg.num_layers), 1, 0)}


@dataclass(frozen=True)
class Part:
    """Elements one rank holds of one part of a shard: the embedding, one decoder layer, or the final norm
    and LM head."""

    total: int = 0
    largest_matrix: int = 0  # the largest 2-D parameter the CPU re-layout copies (not the embedding)
    largest_read: int = 0  # the largest single slice read from the checkpoint
    products: tuple[tuple[int, int], ...] = ()  # (out, in) of each product int8 can store (a layer's), sorted
    spans: tuple[int, ...] = ()  # per product read (a layer's), sorted: elements from its first to its last in the file
    # per product read, its int8 weight's and its scales' bytes from first to last in the int8 copy (`int8_copy`)
    int8_spans: tuple[int, ...] = ()
    int8_whole: int = 0  # bytes of the whole products' (every rank's) int8 values and scales: one layer's copy file

    @property
    def largest_product(self) -> int:
        return max((o * i for o, i in self.products), default=0)

    def nbytes(self, dtype: DType, quantization: Quantization = Quantization.NONE) -> int:
        """Bytes of the part in `dtype`, its products stored as `quantization` says (`Quantization.weight_bytes`:
        int8 values plus a float16 scale and minimum per group of inputs of each local output row)."""
        in_products = sum(o * i for o, i in self.products)
        stored = sum(quantization.weight_bytes(o, i, dtype) for o, i in self.products)
        return (self.total - in_products) * dtype.itemsize + stored


@dataclass(frozen=True)
class WeightParts:
    """One tensor rank's share of each part of the model (all decoder layers have the same shapes)."""

    embedding: Part  # the first stage's extra
    layer: Part  # one decoder layer
    head: Part  # the last stage's extra


def _span(s: TensorSlice) -> int:
    """Elements of the checkpoint tensor from the slice's first to its last (row-major; rows and columns step 1):
    its own for whole rows, `(rows - 1) × full columns + its columns` for a slice of some columns."""
    if len(s.full) != 2:
        return s.numel
    return (s.local[0] - 1) * s.full[1] + s.local[1]


def _int8_spans(s: TensorSlice) -> tuple[int, int]:
    """Bytes of the int8 copy a slice's reads span (`engine.int8_copy`): its int8 values, one byte each, as `_span`
    counts elements, and its rows' float16 (scale, minimum) pairs, 4 bytes a group, the groups of its columns."""
    groups, local_groups = -(-s.full[1] // INT8_GROUP), -(-s.local[1] // INT8_GROUP)
    scales = s.local[0] * groups * 4 if s.local[1] == s.full[1] else ((s.local[0] - 1) * groups + local_groups) * 4
    return _span(s), scales


def _part(slices: list[TensorSlice], relaid: bool = True, quantizable: bool = False) -> Part:
    params: dict[str, tuple[int, ...]] = {}  # the slices stacked by rows into their parameters
    for s in slices:
        rows = params.get(s.target, (0,))[0] + s.local[0]
        params[s.target] = (rows, *s.local[1:])
    matrices = [math.prod(shape) for shape in params.values() if len(shape) == 2] if relaid else []
    products = sorted((shape[0], shape[1]) for shape in params.values() if len(shape) == 2) if quantizable else []
    spans = sorted(_span(s) for s in slices if len(params[s.target]) == 2) if quantizable else []
    int8 = sorted(b for s in slices if len(params[s.target]) == 2 for b in _int8_spans(s)) if quantizable else []
    whole = {s.source: s.full for s in slices if len(params[s.target]) == 2} if quantizable else {}
    int8_whole = sum(Quantization.INT8.weight_bytes(o, i, DType.FLOAT32) for o, i in whole.values())
    return Part(sum(s.numel for s in slices), max(matrices, default=0), max((s.numel for s in slices), default=0),
                tuple(products), tuple(spans), tuple(int8), int8_whole)  # fmt: skip


@functools.lru_cache(maxsize=512)
def weight_parts(cfg: ModelConfig, tp: int, rank: int, split: TpSplit = ()) -> WeightParts:
    """The embedding, one decoder layer and the head, as rank `rank` of `tp` holds them (by `split`'s shares)."""
    # Lookups keep the embedding's row-major layout: it is never re-laid out. The layers' matrices and the LM head
    # are the products int8 stores.
    return WeightParts(_part(_embedding(cfg, tp, rank, split), relaid=False),
                       _part(_layer(cfg, 0, tp, rank, split), quantizable=True),
                       _part(_head(cfg, tp, rank, split), quantizable=True))  # fmt: skip
