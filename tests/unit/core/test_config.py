"""config.json parsing: every family's dialect accepted, everything we do not implement refused by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardmesh.core.config import ConfigError, ModelConfig

BASE = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
}  # fmt: skip


def cfg(**kw) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, **kw})


def test_llama31_rope_scaling_old_and_new_spelling() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    old = cfg(rope_scaling=scaling, rope_theta=500000.0)
    new = cfg(rope_parameters={**scaling, "rope_theta": 500000.0})
    assert old == new and old.rope_theta == 500000.0 and old.rope_scaling.factor == 8.0


def test_defaults_and_explicit_head_dim() -> None:
    c = cfg()
    assert c.head_dim == 16 and c.rope_theta == 10000.0 and c.rope_scaling is None and not c.tie_word_embeddings
    assert cfg(head_dim=24).head_dim == 24
    assert cfg(eos_token_id=[2, 7]).eos_token_ids == (2, 7)


def test_qwen2_bias_and_mistral_window() -> None:
    q = cfg(architectures=["Qwen2ForCausalLM"])
    assert q.attention_bias and not q.o_proj_bias
    m = cfg(architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768)
    assert m.max_context == 4096


@pytest.mark.parametrize(
    "override,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_parameters.low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"pretraining_tp": 2}, "pretraining_tp"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
        ({"head_dim": 15}, "head_dim"),
    ],
)
def test_unsupported_is_refused_naming_the_field(override: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=f"field '{field}'") as e:
        cfg(**override)
    assert e.value.field_name == field


def test_missing_required_field(tmp_path: Path) -> None:
    raw = dict(BASE)
    del raw["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config.json: field 'vocab_size': is required"):
        ModelConfig.from_dir(tmp_path)


def test_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
