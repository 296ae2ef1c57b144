"""One-token segments attended in one call per layer (`DecodeRows`) give what one call per sequence gives,
whatever their slots, positions and order, beside prompt chunks in the same step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardmesh.core.layout import ShardSpec
from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout
from shardmesh.engine.kv_cache import KVCache
from shardmesh.engine.loader import build_shard
from shardmesh.engine.model import Transformer
from tests.checkpoints import make_checkpoint

PROMPTS = [[1, 5, 9, 4], [1, 7], [1, 3, 3, 8, 2, 6], [1, 11, 12], [1, 4, 4, 4, 4]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    d = make_checkpoint(tmp_path_factory.mktemp("gqa"), "llama-gqa-tied", num_layers=2, seed=3)
    return build_shard(d, ShardSpec(0, 2, 2), progress=False, max_len=64)


def prefilled(model: Transformer, slots: list[int], dtype: torch.dtype = torch.float32) -> KVCache:
    """A cache in `dtype` holding PROMPTS[i] in slots[i], each written alone."""
    cache = model.make_cache(12, dtype, "cpu")
    with torch.inference_mode():
        for slot, prompt in zip(slots, PROMPTS, strict=False):
            model(torch.tensor(prompt), BatchLayout.build([Segment(slot, 0, len(prompt))]), cache)
    return cache


def one_call_each(batch: BatchLayout) -> BatchLayout:
    """The same step, every segment attended on its own (the path prompt chunks take)."""
    rows = [0]
    for s in batch.segments[:-1]:
        rows.append(rows[-1] + s.length)
    return dataclasses.replace(batch, decode=None, looped=tuple(zip(rows, batch.segments, strict=True)))


def run_both(model: Transformer, slots: list[int], segments: list[Segment], ids: list[int]) -> BatchLayout:
    batch = BatchLayout.build(segments)
    with torch.inference_mode():
        together_cache, alone_cache = prefilled(model, slots), prefilled(model, slots)
        together = model(torch.tensor(ids), batch, together_cache, all_logits=True)
        alone = model(torch.tensor(ids), one_call_each(batch), alone_cache, all_logits=True)
    assert (together - alone).abs().max() < 1e-5
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    assert (together_cache.data - alone_cache.data).abs().max() < 1e-6  # the same keys and values written
    return batch


def decode(slots: list[int], order: list[int]) -> list[Segment]:
    """One new token for the sequences `order` (indices into PROMPTS), prefilled in `slots`."""
    return [Segment(slots[i], len(PROMPTS[i]), 1) for i in order]


def test_slots_in_order_at_different_positions(model: Transformer) -> None:
    slots = [0, 1, 2, 3]
    batch = run_both(model, slots, decode(slots, [0, 1, 2, 3]), [9, 8, 7, 6])
    assert batch.decode is not None and batch.decode.in_order and batch.decode.mask is not None
    assert batch.looped == ()


def test_slots_out_of_order_with_a_gap(model: Transformer) -> None:
    slots = [5, 2, 3, 7]  # range 2..7 holds 4 of 6 slots: dense enough, with slots 4 and 6 in no segment
    batch = run_both(model, slots, decode(slots, [0, 1, 3, 2]), [9, 8, 7, 6])
    assert batch.decode is not None and not batch.decode.in_order
    assert (batch.decode.first_slot, batch.decode.span) == (2, 6)


def test_sparse_slots_are_attended_one_call_each(model: Transformer) -> None:
    slots = [0, 11]
    batch = run_both(model, slots, decode(slots, [0, 1]), [9, 8])
    assert batch.decode is None and len(batch.looped) == 2


def test_equal_positions_need_no_mask(model: Transformer) -> None:
    slots = [3, 4]  # 4 tokens cached in slot 3, 2 in slot 4: both new tokens go to position 2 (slot 3's
    segments = [Segment(3, 2, 1), Segment(4, 2, 1)]  # is rewritten, as after a rolled-back step)
    batch = run_both(model, slots, segments, [9, 8])
    assert batch.decode is not None and batch.decode.mask is None and batch.decode.in_order


def test_decodes_beside_a_prompt_chunk(model: Transformer) -> None:
    slots = [0, 1, 2, 3, 4]
    # A chunk of PROMPTS[4]'s continuation first in the packed rows, then three decodes, then a one-token
    # prompt (position 0 of slot 6: a one-token segment that starts a sequence).
    segments = [Segment(4, 5, 3), *decode(slots, [2, 0, 1]), Segment(6, 0, 1)]
    batch = run_both(model, slots, segments, [5, 6, 7, 9, 8, 7, 1])
    assert batch.decode is not None and [s.slot for _, s in batch.looped] == [4]
    assert batch.decode.rows == slice(3, 7)


def test_one_decode_takes_the_one_call_path(model: Transformer) -> None:
    batch = run_both(model, [0, 1], decode([0, 1], [1]), [9])
    assert batch.decode is None and len(batch.looped) == 1


def test_decodes_apart_in_the_packed_rows(model: Transformer) -> None:
    slots = [0, 1, 2, 3, 4]
    segments = [decode(slots, [0])[0], Segment(4, 5, 2), decode(slots, [1])[0]]
    batch = run_both(model, slots, segments, [9, 5, 6, 8])
    assert batch.decode is not None and batch.decode.rows.tolist() == [0, 3]
