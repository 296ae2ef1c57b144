"""The model's name for clients: the coordinator's --model as given, carried in the topology's ModelSpec (the
OpenAI-compatible API's default model id)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator import app
from shardmesh.core.topology import ModelSpec

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"


def test_model_spec_carries_the_name_as_given() -> None:
    spec = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128, served_model_name="org/tiny")
    assert ModelSpec.from_pb(spec.to_pb()) == spec and spec.name == "org/tiny"
    unnamed = ModelSpec("/models/tiny", "float32", "LlamaForCausalLM", 4, 32, 100, 128)
    assert ModelSpec.from_pb(unnamed.to_pb()).name == "/models/tiny"  # an older coordinator's: the path


def test_the_coordinator_names_the_model_by_its_model_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(CONFIGS)
    parser = argparse.ArgumentParser()
    app.add_arguments(parser)
    cfg = app.build_config(parser.parse_args(["--listen", "127.0.0.1:0", "--model", "llama-3-8b"]))
    assert cfg.model.served_model_name == "llama-3-8b" and cfg.model.path == str(CONFIGS / "llama-3-8b")
