"""One llama-architecture GGUF file -> an HF-style float32 directory the mesh (and transformers) can load.

The directory holds ``config.json`` + float32 ``model.safetensors`` + ``tokenizer.json`` +
``tokenizer_config.json`` + ``generation_config.json``. The conversion uses only ``gguf``/numpy/torch/
safetensors/tokenizers: transformers is a test dependency, not a runtime one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardmesh.models.gguf_metadata import build_config, build_generation_config, read_gguf_metadata
from shardmesh.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config
from shardmesh.models.gguf_weights import convert_weights

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
    """Convert a llama-architecture GGUF into an HF-style float32 directory at ``out_dir`` (every file
    of ``REQUIRED_FILES``); the weights as ``gguf_weights.convert_weights`` makes them."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = read_gguf_metadata(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = build_config(meta, tied_embeddings=tied)
    state = convert_weights(reader.tensors, config, progress=progress)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", build_generation_config(config))
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(meta))
