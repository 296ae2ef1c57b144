"""`BatchLayout.advanced(k)`, what a decode call's later steps run on, is the layout `build` gives for the same
segments k positions on: field by field, for one sequence, dense and sparse slots, sequences at different positions
(a mask), a prompt chunk among decode rows, and a paged layout (built again)."""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace
from typing import Any

import pytest
import torch

from shardmesh.core.step import Segment
from shardmesh.engine.batch import BatchLayout, DecodeRows


def same(a: Any, b: Any, where: str = "layout") -> None:
    """Equal dataclasses, field by field; tensors equal in values, dtype and device."""
    if is_dataclass(a) and not isinstance(a, type):
        assert type(a) is type(b), where
        for f in fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, where
        assert torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, tuple | list):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


LAYOUTS = {
    "one sequence": [Segment(3, 40, 1)],
    "dense, one position": [Segment(i, 17, 1) for i in range(16)],
    "dense, positions differ (mask)": [Segment(i, 10 + 3 * (i % 4), 1) for i in range(8)],
    "slots missing from the range (mask)": [Segment(0, 5, 1), Segment(2, 9, 1), Segment(3, 9, 1)],
    "sparse slots (one call each)": [Segment(0, 5, 1), Segment(9, 7, 1)],
    "a prompt chunk among decode rows": [Segment(2, 4, 1), Segment(0, 0, 5), Segment(1, 8, 1), Segment(3, 2, 1)],
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2, 7])
def test_a_layout_advanced_is_the_layout_built_k_positions_on(name: str, k: int) -> None:
    segments = LAYOUTS[name]
    base = BatchLayout.build(segments)
    on = BatchLayout.build([replace(s, start=s.start + k) for s in segments])
    same(base.advanced(k), on)
    same(base.advanced(1).advanced(k), BatchLayout.build([replace(s, start=s.start + k + 1) for s in segments]))
    assert base.advanced(k).positions.data_ptr() != base.positions.data_ptr()  # never this layout's tensors moved


def test_the_layouts_cover_each_kind_of_decode_rows() -> None:
    decode = {name: BatchLayout.build(segs).decode for name, segs in LAYOUTS.items()}
    assert decode["one sequence"] is None and decode["sparse slots (one call each)"] is None
    masks = {name: d.mask is not None for name, d in decode.items() if isinstance(d, DecodeRows)}
    assert masks == {
        "dense, one position": False,
        "dense, positions differ (mask)": True,
        "slots missing from the range (mask)": True,
        "a prompt chunk among decode rows": True,
    }


def test_a_paged_layout_advanced_is_built_again_at_the_new_positions() -> None:
    segments = [Segment(0, 5, 1, blocks=(4, 1)), Segment(1, 3, 1, blocks=(2, 7))]
    base = BatchLayout.build(segments, block_size=4)
    same(base.advanced(2), BatchLayout.build([replace(s, start=s.start + 2) for s in segments], block_size=4))
    assert base.kv_index[0].tolist() == [1, 2]  # positions 5 and 3: their tables' second and first blocks
    assert base.advanced(2).kv_index[0].tolist() == [1, 7]  # 7 and 5: both in their second
