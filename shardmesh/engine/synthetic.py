"""Checkpoints of any size in a moment, for measuring memory: every tensor the model reads, all zeros.

The safetensors file is written as its header and then extended to its full length without writing
the data (a sparse file: the holes read back as zeros), so a 1 GB checkpoint costs a few milliseconds
and no disk space. The tensor list comes from the same meta-model route `build_shard` reads by.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from shardmesh.core.config import ModelConfig
from shardmesh.core.dtypes import DType


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor a full model reads, with its shape (a tied head reads the embedding)."""
    from shardmesh.core.layout import ShardSpec
    from shardmesh.engine.groups import UnboundGroup
    from shardmesh.engine.loader import meta_shard

    _, reads = meta_shard(cfg, ShardSpec(0, cfg.num_layers, cfg.num_layers), UnboundGroup(0, 1), None)
    return {r.source: r.full_shape for r in reads}


def write_checkpoint(out_dir: str | Path, config: dict[str, Any], dtype: str = "float32") -> Path:
    """Write config.json and a zero-filled, sparse model.safetensors for `config` (an HF config dict)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(config)
    code, size = DType(dtype).safetensors, DType(dtype).itemsize
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in sorted(tensor_shapes(cfg).items()):
        n = size
        for dim in shape:
            n *= dim
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    (d / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    with (d / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return d
