"""A llama-architecture GGUF's tensors as the float32 weights of transformers' ``LlamaForCausalLM``.

Every tensor is dequantized to float32 (the mesh computes in float32; the file is Q4_1/Q8_0/F32), renamed
to transformers' Llama names, and q/k rows are un-permuted back to HF's RoPE layout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its transformers Llama name; unknown names are an error,
    because silently dropping a tensor (e.g. ``rope_freqs``) would produce a subtly wrong model."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF Llama applies rotary embeddings "rotate_half" style: within each head, rows [0, d/2) pair
    with rows [d/2, d). llama.cpp's converter reorders each head's rows to interleave those halves
    (x0, y0, x1, y1, ...) for its own RoPE kernel. Per head, the GGUF rows are therefore laid out as
    (d/2, 2); swapping back to (2, d/2) restores the HF layout. ``n_head`` is the number of heads
    the tensor holds: attention heads for q, key/value heads for k.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes of every weight a Llama with ``config`` has (lm_head only when untied)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "self_attn.q_proj.weight": (q_rows, hidden),
        "self_attn.k_proj.weight": (kv_rows, hidden),
        "self_attn.v_proj.weight": (kv_rows, hidden),
        "self_attn.o_proj.weight": (hidden, q_rows),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        for suffix, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{suffix}"] = shape
    return shapes


def dequantize_tensor(tensor: Any, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """One GGUF tensor as (HF name, float32 array in torch dimension order).

    ``gguf`` reports ``tensor.shape`` in ggml order (fastest dim first) but ``dequantize`` already
    returns a numpy array in row-major (torch) order, so no transpose is needed here.
    """
    from gguf.quants import dequantize

    name = hf_tensor_name(tensor.name)
    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
    if name.endswith("self_attn.q_proj.weight"):
        values = unpermute_rope_rows(values, config["num_attention_heads"])
    elif name.endswith("self_attn.k_proj.weight"):
        values = unpermute_rope_rows(values, config["num_key_value_heads"])
    return name, values


def convert_weights(tensors: Iterable[Any], config: dict[str, Any], *, progress: bool = True) -> dict:
    """Dequantize every tensor to float32 torch tensors keyed by HF name, checking shapes."""
    import torch
    from tqdm import tqdm

    tensors = list(tensors)
    shapes = expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    bar = tqdm(tensors, desc="converting GGUF tensors", unit="tensor", file=sys.stderr, delay=1.0, disable=not progress)
    for tensor in bar:
        name, values = dequantize_tensor(tensor, config)
        if shapes.get(name) != tuple(values.shape):
            raise ValueError(f"{tensor.name} -> {name}: shape {values.shape}, expected {shapes.get(name)}")
        state[name] = torch.from_numpy(np.ascontiguousarray(values))
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ValueError(f"GGUF is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return state
