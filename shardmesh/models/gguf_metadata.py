"""A GGUF file's key/value metadata as plain values, and the HF ``config.json`` it describes.

Only llama.cpp's ``llama`` architecture is understood; its ``llama.*`` keys map one to one onto a
``LlamaForCausalLM`` config.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_TOKEN_ID_KEYS = (
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("padding_token_id", "pad_token_id"),
)


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    """All key/value fields of a ``gguf.GGUFReader`` as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def required(meta: dict[str, Any], key: str) -> Any:
    """``meta[key]``, or a ValueError naming the missing key."""
    if key not in meta:
        raise ValueError(f"GGUF metadata lacks required key {key!r}")
    return meta[key]


def _f32(value: float) -> float:
    """GGUF stores floats as float32; give back the shortest decimal that round-trips (1e-5, not
    9.999999747378752e-06), which is what the original HF config said."""
    return float(str(np.float32(value)))


def build_config(meta: dict[str, Any], *, tied_embeddings: bool) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config.json from llama.cpp's ``llama.*`` metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only the 'llama' GGUF architecture is supported, got {arch!r}")
    hidden = int(required(meta, "llama.embedding_length"))
    n_head = int(required(meta, "llama.attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_head))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_head))
    vocab = int(meta.get("llama.vocab_size", len(required(meta, "tokenizer.ggml.tokens"))))
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(required(meta, "llama.feed_forward_length")),
        "num_hidden_layers": int(required(meta, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(required(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    for gguf_key, hf_key in _TOKEN_ID_KEYS:
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return config


def build_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special ids generation needs (eos stops decoding)."""
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
