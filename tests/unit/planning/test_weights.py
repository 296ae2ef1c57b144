"""The planner's torch-free count of what a tensor rank holds equals the engine's meta shard, part by part, for
every model family x tensor degree x rank; and the checkpoint it expects is the one the engine reads."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import INT8_GROUP, DType, Quantization
from shardmesh.core.heads import valid_tp_degrees
from shardmesh.core.layout import ShardSpec
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.int8_copy import int8_reads
from shardmesh.engine.linear import int8_products
from shardmesh.engine.loader import meta_shard
from shardmesh.planning.weights import Part, WeightParts, checkpoint_shapes, shard_slices, weight_parts
from tests.checkpoints import FAMILIES

# The shapes tests/checkpoints.py gives every family, and variants that exercise what the families do not:
# a vocabulary no tensor degree divides (the last rank's rows are short) and biases on every projection.
BASE = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
        "max_position_embeddings": 256}  # fmt: skip
# "int8-groups": heads of 32 dims and an FFN of 256, so tensor-parallel slices of inputs start on int8 groups.
VARIANTS = {"as-is": {}, "odd-vocab": {"vocab_size": 97}, "all-biases": {"attention_bias": True, "mlp_bias": True},
            "int8-groups": {"hidden_size": 128, "intermediate_size": 256}}  # fmt: skip


def _config(family: str, variant: str) -> ModelConfig:
    spec: dict[str, Any] = dict(FAMILIES[family])
    arch = f"{spec.pop('cls')}ForCausalLM"
    return ModelConfig.from_hf({"architectures": [arch], **BASE, **spec, **VARIANTS[variant]})


def _span(shape: tuple[int, ...], index: Any) -> int:
    """Elements of a row-major tensor from a read's first to its last, as `engine.offload._byte_range` counts."""
    index = (index or ()) + (slice(None),) * (len(shape) - len(index or ()))
    stride, first, last = 1, 0, 0
    for dim, s in zip(reversed(shape), reversed(index), strict=True):
        start, stop, _ = s.indices(dim)
        first, last = first + start * stride, last + (stop - 1) * stride
        stride *= dim
    return last + 1 - first


def _meta_parts(cfg: ModelConfig, tp: int, rank: int) -> tuple[WeightParts, bool]:
    """The engine's count: parameters and checkpoint reads of one-layer meta shards at each end of the model;
    the products int8 stores (`int8_products`) and the bytes their reads span in the int8 copy (`int8_reads`: int8
    values, float16 scales), and whether the copy serves this rank (its slices of inputs start on int8 groups)."""
    params: dict[str, list[tuple[int, int]]] = {"embedding": [], "layer": [], "head": []}  # (numel, dim)
    reads: dict[str, list[int]] = {"embedding": [], "layer": [], "head": []}
    products: dict[str, list[tuple[int, int]]] = {"embedding": [], "layer": [], "head": []}
    spans: dict[str, list[int]] = {"embedding": [], "layer": [], "head": []}  # products' reads, first to last element
    int8_spans: dict[str, list[int]] = {"embedding": [], "layer": [], "head": []}  # bytes, in the int8 copy
    whole: dict[str, dict[str, tuple[int, ...]]] = {"embedding": {}, "layer": {}, "head": {}}  # products' sources
    copy_serves = True

    def part_of(name: str) -> str:
        return "embedding" if name.startswith("model.embed_tokens.") else "layer" if ".layers." in name else "head"

    last = cfg.num_layers - 1
    for start in (0, last):
        model, planned = meta_shard(cfg, ShardSpec(start, start + 1, cfg.num_layers, rank, tp), UnboundGroup(rank, tp),
                                    None)  # fmt: skip
        quantized = int8_products(model)
        for name, p in model.named_parameters():
            if part_of(name) != "layer" or start == 0:  # one layer, not two
                params[part_of(name)].append((p.numel(), p.dim()))
                if name in quantized:
                    products[part_of(name)].append((p.shape[0], p.shape[1]))
        for r in planned:
            if part_of(r.target) != "layer" or start == 0:
                reads[part_of(r.target)].append(r.numel)
                if r.target in quantized:
                    spans[part_of(r.target)].append(_span(r.full_shape, r.index))
                    whole[part_of(r.target)][r.source] = r.full_shape
                    try:
                        values, scales = int8_reads(r)
                    except ValueError:
                        copy_serves = False
                        continue
                    int8_spans[part_of(r.target)] += [_span(values.full_shape, values.index),
                                                      2 * _span(scales.full_shape, scales.index)]  # fmt: skip

    def part(key: str) -> Part:
        int8 = Quantization.INT8
        matrices = [n for n, dim in params[key] if dim == 2 and key != "embedding"]  # lookups are not re-laid out
        return Part(sum(n for n, _ in params[key]), max(matrices, default=0), max(reads[key], default=0),
                    tuple(sorted(products[key])), tuple(sorted(spans[key])),
                    tuple(sorted(int8_spans[key])),
                    sum(int8.weight_bytes(o, i, DType.FLOAT32) for o, i in whole[key].values()))  # fmt: skip

    return WeightParts(part("embedding"), part("layer"), part("head")), copy_serves


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_analytic_parts_equal_the_meta_shard(family: str, variant: str) -> None:
    cfg = _config(family, variant)
    degrees = valid_tp_degrees(cfg)
    assert len(degrees) > 1, degrees  # the families must exercise tensor parallelism at all
    served = 0
    for tp in degrees:
        for rank in range(tp):
            ours, (theirs, copy_serves) = weight_parts(cfg, tp, rank), _meta_parts(cfg, tp, rank)
            if not copy_serves:  # the engine refuses int8 streaming here: nothing to compare the int8 spans with
                ours = replace(ours, layer=replace(ours.layer, int8_spans=theirs.layer.int8_spans))
            served += copy_serves
            assert ours == theirs, (family, variant, tp, rank)
    if variant == "int8-groups" and cfg.head_dim % INT8_GROUP == 0:  # tensor-parallel ranks' int8 spans compared too
        assert served > 1, (family, served)


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_shapes_are_what_the_engine_reads(family: str) -> None:
    cfg = _config(family, "as-is")
    _, reads = meta_shard(cfg, ShardSpec(0, cfg.num_layers, cfg.num_layers), UnboundGroup(0, 1), None)
    assert checkpoint_shapes(cfg) == {r.source: r.full_shape for r in reads}
    # The tied families read their head from the embedding: the checkpoint holds no lm_head.weight.
    assert ("lm_head.weight" in checkpoint_shapes(cfg)) == (not cfg.tie_word_embeddings)


def test_a_whole_stage_is_its_parts() -> None:
    cfg = _config("qwen2-bias-tied", "odd-vocab")
    parts = weight_parts(cfg, 2, 1)
    whole = sum(s.numel for s in shard_slices(cfg, range(cfg.num_layers), 2, 1))
    assert whole == parts.embedding.total + cfg.num_layers * parts.layer.total + parts.head.total
    # rank 1 of 2 holds vocabulary rows [49, 97): 48 of them, in the embedding and in the head
    assert parts.embedding.total == 48 * cfg.hidden_size and parts.head.largest_read == 48 * cfg.hidden_size
