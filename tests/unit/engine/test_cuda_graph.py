"""The fixed-shape decode path that CUDA graphs replay (`cuda_graph.DecodeGraphs`), run uncaptured on the CPU: rows
padded to a bucket, slots gathered up to a length bucket, a mask from positions. It must give what the eager step
gives, whatever the slots, positions, order and padding, and write the same keys and values."""

from __future__ import annotations

import pytest
import torch

from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.cuda_graph import DecodeGraphs, decode_graphs, length_bucket, row_bucket
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from tests.checkpoints import make_checkpoint
from tests.unit.engine.test_model import PROMPTS, prefilled


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    d = make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=2, seed=5)
    return build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=300)


def test_buckets() -> None:
    assert [row_bucket(n, 16) for n in (1, 2, 3, 5, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert row_bucket(5, 6) == 6  # capped at the most rows a cache can decode
    assert [length_bucket(n, 300) for n in (1, 256, 257, 300)] == [256, 256, 300, 300]
    assert length_bucket(600, 4096) == 1024
    with pytest.raises(ValueError, match="rows must be in"):
        row_bucket(17, 16)
    with pytest.raises(ValueError, match="length must be in"):
        length_bucket(301, 300)


@pytest.mark.parametrize(
    "slots,order,steps",
    [([0], [0], 3), ([3, 0, 7], [2, 0, 1], 2), ([5, 1, 2, 8, 11], [4, 1, 3, 0, 2], 2), ([2, 9], [1], 1)],
)
def test_fixed_shape_path_equals_eager(model: Transformer, slots: list[int], order: list[int], steps: int) -> None:
    eager_cache, graph_cache = prefilled(model, slots), prefilled(model, slots)
    graphs = DecodeGraphs(model, graph_cache, torch.device("cpu"), capture=False)
    positions = {i: len(PROMPTS[i]) for i in order}
    for step in range(steps):
        segments = [Segment(slots[i], positions[i], 1) for i in order]
        ids = torch.tensor([7 + 3 * i + step for i in order])
        batch = BatchLayout.build(segments)
        assert graphs.accepts(batch, all_logits=False)
        with torch.inference_mode():
            eager = model(ids, batch, eager_cache)
            fixed = graphs.run(batch, ids)
        assert fixed.shape == eager.shape
        assert (fixed - eager).abs().max() < 1e-5
        assert torch.equal(fixed.argmax(-1), eager.argmax(-1))
        for i in order:
            positions[i] += 1
    # the padded rows wrote row 0's key and value again, nowhere else: both caches hold the same bytes
    assert (graph_cache.data - eager_cache.data).abs().max() < 1e-6
    assert set(graphs.graphs) == {(row_bucket(len(order), 12), 256)}


def test_declines_what_it_cannot_replay(model: Transformer) -> None:
    graphs = DecodeGraphs(model, prefilled(model, [0, 1]), torch.device("cpu"), capture=False)
    prompt = BatchLayout.build([Segment(0, len(PROMPTS[0]), 1), Segment(1, 0, 2)])
    assert not graphs.accepts(prompt, all_logits=False)  # a prompt chunk
    one = BatchLayout.build([Segment(0, len(PROMPTS[0]), 1)])
    assert not graphs.accepts(one, all_logits=True)
    assert graphs.accepts(one, all_logits=False)
    # only CUDA shards with a slot cache and no tensor-parallel group get graphs
    cache = model.make_cache(2, torch.float32, "cpu")
    assert decode_graphs(model, cache, torch.device("cpu"), 1) is None
    paged = model.make_paged_cache(8, 4, torch.float32, "cpu")
    assert decode_graphs(model, paged, torch.device("cuda"), 1) is None
