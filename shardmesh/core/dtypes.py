"""The dtypes a mesh serves in, defined once: the names flags and manifests take, bytes per element, how
Hugging Face configs and safetensors headers spell them, and their wire enum.

The torch dtype of each is the engine's business (`shardmesh.engine.loader.TORCH_DTYPES`, keyed by
`DType`). This module imports neither torch nor protobuf, so command-line parsers list the names
without loading either.
"""

from __future__ import annotations

import enum


class DType(str, enum.Enum):
    """A serving dtype. A `str` whose value is its name, so it equals ``"float32"`` and prints as it."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """("float32", "bfloat16", "float16"): argparse `choices`, and the order every message lists them in."""
        return tuple(d.value for d in cls)

    @classmethod
    def parse(cls, name: str) -> DType:
        """The dtype called `name`; ValueError listing the names otherwise."""
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"dtype must be one of {', '.join(cls.names())}, got {name!r}") from None

    @classmethod
    def from_hf(cls, name: str) -> DType | None:
        """A stored dtype as config.json's `torch_dtype` ("bfloat16", "float", "half") or a safetensors
        header code ("BF16") names it; None for one we do not serve in (F64, I8, ...)."""
        return _HF_NAMES.get(name)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @property
    def safetensors(self) -> str:
        """The code a safetensors header stores it as: F32, BF16, F16."""
        return _SAFETENSORS[self]

    def to_pb(self) -> int:
        """The `shardmesh.v1.DType` value."""
        from shardmesh.proto.v1 import common_pb2  # on first use: the parsers above read names only

        return common_pb2.DType.Value(f"DTYPE_{self.name}")

    @classmethod
    def from_pb(cls, value: int) -> DType:
        """ValueError for DTYPE_UNSPECIFIED and values this version does not know."""
        from shardmesh.proto.v1 import common_pb2

        wire = common_pb2.DType.Name(value) if value in common_pb2.DType.values() else str(value)
        name = wire.removeprefix("DTYPE_")
        if name not in cls.__members__:
            raise ValueError(f"dtype must be one of {', '.join(cls.names())}, got {wire}")
        return cls[name]


_ITEMSIZE = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}
_SAFETENSORS = {DType.FLOAT32: "F32", DType.BFLOAT16: "BF16", DType.FLOAT16: "F16"}
_HF_NAMES = {
    **{d.value: d for d in DType},
    **{code: d for d, code in _SAFETENSORS.items()},
    "float": DType.FLOAT32,
    "half": DType.FLOAT16,
}


QUANTIZE_HELP = (
    "int8: the decoder layers' products and the LM head held as int8 with a float16 scale and minimum per 32 "
    "inputs of a row, made while loading from the float checkpoint (1.125 bytes per weight, 28%% of float32's); "
    "the embedding and norms stay in --dtype (default none)"
)


# Input features per int8 group (a scale and a minimum each): the block size of llama.cpp's Q8_0 and Q4_1, whose
# grids an int8 group of this size holds exactly. Every tensor-parallel degree holds the same numbers where a
# row-parallel product's slices hold whole groups; the loader logs the products whose slices split one.
INT8_GROUP = 32
# Elements of a product quantized at a time (whole rows, at least one), with at most `INT8_QUANTIZE_TEMP_BYTES` bytes
# of float64 temporaries per element (`shardmesh.engine.linear.quantize_groups`; the memory model counts them).
INT8_QUANTIZE_CHUNK = 1 << 20
INT8_QUANTIZE_TEMP_BYTES = 48


class Quantization(str, enum.Enum):
    """How a shard's matrix products store their weights. A `str` whose value is its name.

    NONE: in the serving dtype, as loaded. INT8: int8 values with a float16 scale and minimum per
    `INT8_GROUP` input features of each output row (weight-only: activations stay in the serving dtype), made
    at load from a float checkpoint (`shardmesh.engine.linear.quantize_groups` says how each group's grid is
    chosen), for the decoder layers' products and the LM head. The embedding and the norms stay in the serving
    dtype.
    """

    NONE = "none"
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(q.value for q in cls)

    @classmethod
    def parse(cls, name: str) -> Quantization:
        """The quantization called `name` ("" is none: what a peer older than the field sends); ValueError
        listing the names otherwise."""
        try:
            return cls(name or cls.NONE.value)
        except ValueError:
            raise ValueError(f"quantization must be one of {', '.join(cls.names())}, got {name!r}") from None

    def weight_bytes(self, out_features: int, in_features: int, dtype: DType) -> int:
        """Bytes one product's weight takes on a device: int8 values plus a float16 scale and minimum per group
        of `INT8_GROUP` inputs of each output row."""
        if self is Quantization.INT8:
            return out_features * in_features + 4 * out_features * -(-in_features // INT8_GROUP)
        return out_features * in_features * dtype.itemsize
