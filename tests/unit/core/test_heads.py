"""Head splits (each tensor rank's query heads keep their kv head, impossible degrees refused) and vocab ranges."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from shardmesh.core.config import ModelConfig
from shardmesh.core.heads import (
    HeadSplit,
    TensorParallelError,
    check_tp_split,
    mlp_range,
    parse_tp_split,
    valid_tp_degrees,
    vocab_range,
)

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


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
        ranges = [vocab_range(vocab, r, size) for r in range(size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_valid_degrees_match_head_split() -> None:
    for name in ("llama-3-8b", "llama-3-70b", "qwen2-72b"):
        cfg = ModelConfig.from_dir(CONFIGS / name)
        for d in range(1, 17):
            try:
                HeadSplit.of(cfg, 0, d)
                ok = cfg.intermediate_size % d == 0
            except TensorParallelError:
                ok = False
            assert (d in valid_tp_degrees(cfg)) == ok, (name, d)


def test_a_tp_split_gives_each_rank_its_shares_of_the_mlp_and_the_vocabulary() -> None:
    cfg = ModelConfig.from_dir(CONFIGS / "llama-3-8b")  # intermediate_size 14336 = 4 x 3584
    assert parse_tp_split("2,1,1") == (2, 1, 1) and parse_tp_split(" ") == ()
    assert [mlp_range(cfg, r, 3, (2, 1, 1)) for r in range(3)] == [(0, 7168), (7168, 10752), (10752, 14336)]
    assert [mlp_range(cfg, r, 2, (1, 3)) for r in range(2)] == [(0, 3584), (3584, 14336)]
    # the vocabulary in units of ceil(vocab / 4): 97 -> 25, so 50 + 25 + 22
    assert [vocab_range(97, r, 3, (2, 1, 1)) for r in range(3)] == [(0, 50), (50, 75), (75, 97)]
    assert [vocab_range(97, r, 2, ()) for r in range(2)] == [vocab_range(97, r, 2, (1, 1)) for r in range(2)]
    check_tp_split(cfg, 3, ())  # even: nothing to check
    for split, size, message in [((2, 1), 3, "has 2 shares for tensor parallel degree 3"),
                                 ((2, 3), 2, "its shares add up to 5, which must divide intermediate_size=14336"),
                                 ((0, 1), 2, "every share must be at least 1")]:  # fmt: skip
        with pytest.raises(TensorParallelError, match=message):
            check_tp_split(cfg, size, split)
    for text, message in [("2,a", "expected whole numbers and commas"), ("1,-1", "every share must be at least 1")]:
        with pytest.raises(TensorParallelError, match=message):
            parse_tp_split(text)


def test_mlp_ranges_partition_the_intermediate_dimension() -> None:
    cfg = ModelConfig.from_dir(CONFIGS / "llama-3-8b")  # intermediate_size 14336
    assert [mlp_range(cfg, r, 4) for r in range(4)] == [(0, 3584), (3584, 7168), (7168, 10752), (10752, 14336)]
    assert mlp_range(cfg, 0, 1) == (0, 14336)
    with pytest.raises(TensorParallelError, match="tensor parallel degree 3 must divide intermediate_size=14336"):
        mlp_range(cfg, 0, 3)
