"""The tensor-parallel transform: TP=1 vs TP=N slice equality, and stacked products
sliced one block at a time (rank r's qkv is [q_r; k_r; v_r], its gate_up [gate_r; up_r])."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import HeadSplit
from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.groups import UnboundGroup
from shardmesh.engine.linear import LinearProduct
from shardmesh.engine.loader import build_shard
from tests.checkpoints import load_reference, make_checkpoint
from tests.unit.engine.served import served_blocks


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_slices_reassemble_the_unsharded_weights(tmp_path: Path, tp: int) -> None:
    d = make_checkpoint(tmp_path, "llama-mha-untied", num_layers=2, num_attention_heads=4, num_key_value_heads=4)

    def weights(spec: ShardSpec) -> dict[str, torch.Tensor]:  # by checkpoint name, as the shard serves them
        model = build_shard(d, spec, UnboundGroup(spec.tp_rank, spec.tp_size), progress=False)
        return {r.source: t for r, t in served_blocks(model, spec)}

    full = weights(ShardSpec(0, 2, 2))
    parts = [weights(ShardSpec(0, 2, 2, r, tp)) for r in range(tp)]
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


def _products(module: torch.nn.Module) -> int:
    return sum(1 for m in module.modules() if isinstance(m, LinearProduct))


@pytest.mark.parametrize(("family", "tp"), [("qwen2-bias-tied", 1), ("llama-mha-untied", 2)])
def test_stacked_products_hold_each_ranks_blocks_in_order(tmp_path: Path, family: str, tp: int) -> None:
    d = make_checkpoint(tmp_path, family, num_layers=2, seed=5)
    cfg, ckpt = ModelConfig.from_dir(d), load_file(d / "model.safetensors")
    ids = torch.tensor([1, 7, 3, 9, 2])
    for rank in range(tp):  # each rank's share alone: the head and embedding are vocab-split, the rest by heads
        spec = ShardSpec(0, 1, 2, rank, tp)  # the first layer: hidden states out
        m = build_shard(d, spec, UnboundGroup(rank, tp), progress=False)
        layer = m.model.layers["0"]
        assert _products(layer) == 4  # qkv, o, gate_up, down: q/k/v -> 1 and gate/up -> 1
        split, hd = HeadSplit.of(cfg, rank, tp), cfg.head_dim
        q = slice(split.q_start * hd, (split.q_start + split.q_count) * hd)
        kv = slice(split.kv_start * hd, (split.kv_start + split.kv_count) * hd)
        ffn = slice(rank * cfg.intermediate_size // tp, (rank + 1) * cfg.intermediate_size // tp)
        p = "model.layers.0."
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        stacked = torch.cat([ckpt[p + "self_attn.q_proj.weight"][q], ckpt[p + "self_attn.k_proj.weight"][kv],
                             ckpt[p + "self_attn.v_proj.weight"][kv]])  # fmt: skip
        assert torch.equal(qkv.kernel.dense(qkv.weight), stacked)
        gate, up = ckpt[p + "mlp.gate_proj.weight"][ffn], ckpt[p + "mlp.up_proj.weight"][ffn]
        assert torch.equal(gate_up.kernel.dense(gate_up.weight), torch.cat([gate, up]))
        assert (qkv.bias is not None) is cfg.attention_bias
        if qkv.bias is not None:
            biases = [ckpt[p + "self_attn.q_proj.bias"][q], ckpt[p + "self_attn.k_proj.bias"][kv],
                      ckpt[p + "self_attn.v_proj.bias"][kv]]  # fmt: skip
            assert torch.equal(qkv.bias, torch.cat(biases))
        if tp == 1:  # (tp > 1 all-reduces: tests/equivalence runs tp meshes against transformers)
            batch = BatchLayout.build([Segment(0, 0, len(ids))])
            ours = m(ids, batch, m.make_cache(1, torch.float32, "cpu"))
            with torch.inference_mode():  # transformers' separate q/k/v and gate/up products, layer 0's output
                ref = load_reference(d)(ids[None], output_hidden_states=True).hidden_states[1][0]
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
