"""Tests for ``shardmesh.models.gguf_weights``: the GGUF -> float32 weights conversion must be exact.

The reference is transformers' own GGUF loader (dev dependency only). Loading the GGUF through it
takes ~20 s and ~1.2 GB, so it happens once per module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from shardmesh.models.gguf_weights import hf_tensor_name, unpermute_rope_rows
from shardmesh.models.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _load_gguf_reference(gguf: Path) -> torch.nn.Module:
    """The model as transformers loads the GGUF (dequantized to float32).

    ``from_pretrained(gguf_file=...)`` refuses to run without ``accelerate``; without it we take the
    same transformers code path by hand (config from the GGUF + ``load_gguf_checkpoint``).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


@pytest.fixture(scope="module")
def reference_model(gguf_path: Path) -> torch.nn.Module:
    return _load_gguf_reference(gguf_path)


@pytest.fixture(scope="module")
def converted_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


# -- conversion details --------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert script does to q/k rows (HF rotate-half -> interleaved pairs)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("n_head", [9, 3])
def test_unpermute_rope_rows_inverts_llama_cpp(n_head: int) -> None:
    hf = np.random.default_rng(0).standard_normal((n_head * 64, 576)).astype(np.float32)
    permuted = _llama_cpp_permute(hf, n_head)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_head), hf)


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    expected = "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == expected
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# -- the real pulled model -----------------------------------------------------------------------


@pytest.mark.slow
def test_weights_equal_transformers_dequantization(model_dir: Path, reference_model: torch.nn.Module) -> None:
    from safetensors.torch import load_file

    ours = load_file(model_dir / "model.safetensors")
    reference = reference_model.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}
    assert sum(t.numel() for t in ours.values()) == 134_515_008
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])


@pytest.mark.slow
def test_logits_match_and_greedy_answer(
    model_dir: Path, converted_model: torch.nn.Module, reference_model: torch.nn.Module
) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer is not None
    prompt = torch.tensor([tokenizer.encode_chat(QUESTION)])
    with torch.no_grad():
        ours = converted_model(prompt).logits
        reference = reference_model(prompt).logits
        generated = converted_model.generate(prompt, max_new_tokens=16, do_sample=False)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    new_tokens = generated[0, prompt.shape[1] :].tolist()
    assert new_tokens[-1] in tokenizer.eos_token_ids
    assert tokenizer.decode(new_tokens) == "The capital of France is Paris."
