"""Tiny random checkpoints of each supported family, saved by `transformers` as safetensors.

`transformers` is the oracle: the checkpoints are written by it, and reference logits come from
its `*ForCausalLM` classes, so a mismatch is ours.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# SmolLM2-135M-Instruct's geometry, as `shardmesh model pull` writes its config.json (no weights).
SMOLLM2_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192, "vocab_size": 49152,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip

FAMILIES: dict[str, dict[str, Any]] = {
    # name: (config class, config kwargs)
    "llama-gqa-tied": {
        "cls": "Llama", "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    },
    "llama-mha-untied": {
        "cls": "Llama", "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False,
    },
    "llama31-rope-scaling": {
        "cls": "Llama", "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    },
    "mistral-gqa": {"cls": "Mistral", "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": 4096},
    "qwen2-bias-tied": {
        "cls": "Qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    },
    "smollm-like-kv1": {
        "cls": "Llama", "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True,
        "head_dim": 24,
    },
}  # fmt: skip


def make_checkpoint(
    out_dir: Path, family: str, *, num_layers: int = 5, seed: int = 0, dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None, **overrides: Any,
) -> Path:  # fmt: skip
    import transformers

    spec = dict(FAMILIES[family])
    cls_name = spec.pop("cls")
    kwargs: dict[str, Any] = dict(
        vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=num_layers,
        max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    kwargs.update(spec)
    kwargs.update(overrides)
    config = getattr(transformers, f"{cls_name}Config")(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls_name}ForCausalLM")(config).to(dtype).eval()
    # HF initialises biases to 0 and norms to 1, which would hide a bias or norm bug: randomise them,
    # and widen the matrices so logits spread out and greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    save_kwargs: dict[str, Any] = {}
    if max_shard_size:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def load_reference(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(model_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits behind each: [prefill logits (T, V), then one (V,) per decode step]."""
    ref = load_reference(model_dir)
    ids = torch.tensor([prompt])
    out = ref(ids, use_cache=True)
    logits = [out.logits[0].float()]
    past = out.past_key_values
    tokens: list[int] = []
    for _ in range(steps):
        nxt = int(logits[-1][-1].argmax()) if len(tokens) == 0 else int(logits[-1].argmax())
        tokens.append(nxt)
        out = ref(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return tokens, logits


def make_plain_checkpoint(out_dir: Path, *, layers: int, hidden: int, ffn: int, vocab: int,
                          scaled: bool = False) -> Path:  # fmt: skip
    """A Llama checkpoint of any size written straight with safetensors, no transformers model built (multi-head,
    untied, unit norms, random matrices): for memory measurements. `scaled` divides each matrix by the square
    root of its input width, so activations keep their size through the layers and logits stay finite."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": ffn,
           "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": vocab,
           "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / (cols**0.5 if scaled else 1.0)

    t = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
         "lm_head.weight": matrix(vocab, hidden), "model.norm.weight": torch.ones(hidden)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in "qkvo":
            t[p + f"self_attn.{n}_proj.weight"] = matrix(hidden, hidden)
        t[p + "mlp.gate_proj.weight"] = matrix(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = matrix(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = matrix(hidden, ffn)
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    save_file(t, out_dir / "model.safetensors")
    return out_dir
