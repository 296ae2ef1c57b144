"""Tests for ``shardmesh.models.gguf_metadata``: the config.json written from SmolLM2's GGUF metadata says
what the original HF config says."""

from __future__ import annotations

import json
from pathlib import Path


def test_config_json_from_metadata(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 1e5,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": 8192,
    }
    assert {k: config[k] for k in expected} == expected
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
