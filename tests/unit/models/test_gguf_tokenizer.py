"""Tests for ``shardmesh.models.gguf_tokenizer``: the tokenizer rebuilt from SmolLM2's GGUF metadata equals
the one transformers builds from the same file, and tokenizer_config.json names its special tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardmesh.models.tokenizer import Tokenizer


def test_backend_equals_transformers_gguf_tokenizer(ours: Tokenizer, reference: Any) -> None:
    """Structural check: same model, pre-tokenizer, decoder, post-processor and added tokens."""
    ours_json = json.loads(ours._backend.to_str())
    reference_json = json.loads(reference.backend_tokenizer.to_str())
    assert ours_json == reference_json


def test_tokenizer_config_from_metadata(model_dir: Path) -> None:
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]
