"""Shard math on its own: layer splits, head splits, and TP=1 vs TP=N slice equality."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import HeadSplit, TensorParallelError
from shardmesh.core.layout import ShardSpec, shard_specs, split_layers
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import dense
from shardmesh.engine.loader import build_shard
from shardmesh.engine.tp import _vocab_range
from tests.checkpoints import make_checkpoint


@pytest.mark.parametrize("layers,stages", [(n, s) for n in range(1, 12) for s in range(1, n + 1)])
def test_split_layers_covers_every_layer_once(layers: int, stages: int) -> None:
    bounds = split_layers(layers, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    sizes = [e - s for s, e in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_layers_proportional_and_errors() -> None:
    assert split_layers(30, 2, [2.0, 1.0]) == [(0, 20), (20, 30)]
    with pytest.raises(ValueError, match="cannot split 3 layers over 4 stages"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="positive stage weights"):
        split_layers(4, 2, [1.0, 0.0])


def test_shard_specs_rank_order_is_stage_major() -> None:
    specs = shard_specs(5, 3, 2)
    assert [(s.layer_start, s.layer_end, s.tp_rank) for s in specs] == [
        (0, 2, 0), (0, 2, 1), (2, 4, 0), (2, 4, 1), (4, 5, 0), (4, 5, 1)
    ]  # fmt: skip
    assert specs[0].is_first and specs[-1].is_last and not specs[2].is_first


@pytest.mark.parametrize("heads,kv,tp", [(9, 3, 3), (9, 3, 9), (8, 2, 4), (8, 8, 2), (32, 8, 8), (64, 8, 16)])
def test_head_split_gives_each_query_head_its_kv_head(heads: int, kv: int, tp: int) -> None:
    c = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": heads * 8, "intermediate_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
                             "vocab_size": 10})  # fmt: skip
    owned = []
    for rank in range(tp):
        s = HeadSplit.of(c, rank, tp)
        for q in range(s.q_start, s.q_start + s.q_count):
            owned.append(q)
            kv_of_q = q // (heads // kv)
            local_group = (q - s.q_start) // (s.q_count // s.kv_count)  # what grouped attention will use
            assert s.kv_start + local_group == kv_of_q
    assert sorted(owned) == list(range(heads))


def test_head_split_refuses_with_valid_degrees() -> None:
    c = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                             "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3,
                             "vocab_size": 10})  # fmt: skip
    with pytest.raises(TensorParallelError, match=r"valid degrees: \[1, 3, 9\]"):
        HeadSplit.of(c, 0, 2)


def test_vocab_ranges_partition_the_vocabulary() -> None:
    for vocab, size in [(97, 2), (49152, 3), (10, 4), (3, 4)]:
        ranges = [_vocab_range(vocab, r, size) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_reassemble_the_unsharded_weights(tmp_path: Path, tp: int) -> None:
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, num_attention_heads=4, num_key_value_heads=4)

    def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:  # packed CPU weights, as plain tensors
        return {name: dense(p) for name, p in model.named_parameters()}

    full = weights(build_shard(d, ShardSpec(0, 2, 2), progress=False, fuse=False))  # by checkpoint name
    parts = [weights(build_shard(d, ShardSpec(0, 2, 2, r, tp), UnboundGroup(r, tp), progress=False, fuse=False))
             for r in range(tp)]  # fmt: skip
    for name, weight in full.items():
        pieces = [p[name] for p in parts]
        if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
            joined = torch.cat(pieces, dim=0)  # column-parallel (and vocab-parallel): rows of [out, in]
        elif any(k in name for k in ("o_proj", "down_proj")):
            joined = torch.cat(pieces, dim=1)  # row-parallel: columns of [out, in]
        else:
            assert all(torch.equal(p, weight) for p in pieces), f"{name} should be replicated"
            continue
        assert torch.equal(joined, weight), name
