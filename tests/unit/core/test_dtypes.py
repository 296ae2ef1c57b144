"""The one dtype enum: the names every flag and manifest takes, bytes per element, how Hugging Face configs and
safetensors headers spell each, and the wire enum, each both ways."""

from __future__ import annotations

import json

import pytest

from shardmesh.core.dtypes import DType
from shardmesh.proto.v1 import common_pb2


def test_names_and_sizes() -> None:
    assert DType.names() == ("float32", "bfloat16", "float16")
    assert [d.itemsize for d in DType] == [4, 2, 2] and [d.safetensors for d in DType] == ["F32", "BF16", "F16"]
    # a str: equal to its name, printed and serialised as it
    assert DType.BFLOAT16 == "bfloat16" and f"{DType.BFLOAT16}" == str(DType.BFLOAT16) == "bfloat16"
    assert json.dumps({"dtype": DType.FLOAT16}) == '{"dtype": "float16"}'


def test_parse_names_the_choices() -> None:
    assert DType.parse("float16") is DType.FLOAT16
    with pytest.raises(ValueError, match=r"^dtype must be one of float32, bfloat16, float16, got 'int8'$"):
        DType.parse("int8")


@pytest.mark.parametrize(
    ("stored", "expected"),
    [("float32", DType.FLOAT32), ("float", DType.FLOAT32), ("half", DType.FLOAT16), ("bfloat16", DType.BFLOAT16),
     ("F32", DType.FLOAT32), ("BF16", DType.BFLOAT16), ("F16", DType.FLOAT16), ("F64", None), ("I8", None)],
)  # fmt: skip
def test_hugging_face_and_safetensors_spellings(stored: str, expected: DType | None) -> None:
    assert DType.from_hf(stored) is expected


def test_wire_enum_round_trips_and_refuses_unspecified() -> None:
    for d in DType:
        assert common_pb2.DType.Name(d.to_pb()) == f"DTYPE_{d.name}" and DType.from_pb(d.to_pb()) is d
    with pytest.raises(ValueError, match="got DTYPE_UNSPECIFIED"):
        DType.from_pb(common_pb2.DTYPE_UNSPECIFIED)
    with pytest.raises(ValueError, match="got 99"):
        DType.from_pb(99)
