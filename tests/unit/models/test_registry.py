"""Tests for ``shardmesh.models.registry``: names, and every command resolving `--model` the same way.

`generate`, `up`, `coordinator` and a manifest's `model.path` all take a directory or a known model name;
the name is read from the cache (``fake_cache``: nothing is installed or converted here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from coordinator import app as coordinator_app
from shardmesh.models.registry import DEFAULT_MODEL, UnknownModelError, known_models, resolve
from shardmesh.planning import deploy
from shardmesh.planning.manifest import parse_manifest
from shardmesh_cli.main import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "compose" / "manifest.example.yaml"
UNKNOWN = (
    "'no-such-model' is neither a directory, a known model name (smollm2-135m-instruct), nor a Hugging Face "
    "model id (ORG/NAME[@REVISION])"
)


def test_unknown_model_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve("no-such-model", tmp_path)
    assert not (tmp_path / "models").exists()


def test_default_model_is_known() -> None:
    assert DEFAULT_MODEL in known_models()


def test_resolve_takes_a_directory_as_it_is(tmp_path: Path, fake_cache: Path) -> None:
    (tmp_path / DEFAULT_MODEL).mkdir()
    assert resolve(tmp_path / DEFAULT_MODEL) == tmp_path / DEFAULT_MODEL


def test_resolve_reads_a_known_name_from_the_cache(fake_cache: Path) -> None:
    assert resolve(DEFAULT_MODEL) == fake_cache


def _coordinator_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    coordinator_app.add_arguments(parser)
    return parser.parse_args(["--listen", "127.0.0.1:0", *argv])


def test_coordinator_accepts_a_known_model_name(fake_cache: Path) -> None:
    cfg = coordinator_app.build_config(_coordinator_args("--model", DEFAULT_MODEL, "--pp", "2", "--tp", "3"))
    assert cfg.model.path == str(fake_cache.resolve())
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.pp, cfg.tp) == (30, 576, 2, 3)


def test_coordinator_refuses_an_unknown_name_like_generate(
    fake_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["coordinator", "--model", "no-such-model"]) == 2
    assert capsys.readouterr().err == f"error: --model: {UNKNOWN}\n"
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    assert capsys.readouterr().err == f"error: --model: {UNKNOWN}\n"
    with pytest.raises(UnknownModelError, match="neither a directory, a known model name"):
        resolve("no-such-model")


def test_manifest_model_path_takes_a_known_name(tmp_path: Path, fake_cache: Path) -> None:
    m = parse_manifest({"model": {"path": DEFAULT_MODEL}})
    assert deploy.model_dir(m, tmp_path / "m.yaml") == fake_cache


def test_example_manifest_plans_as_the_readme_shows(
    fake_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`shardmesh plan --manifest compose/manifest.example.yaml` on a fresh clone: the example names the
    default model, which resolves (here from the cache) like `up --model NAME`."""
    monkeypatch.chdir(tmp_path)  # the example's path is a name, not a directory that happens to exist here
    assert main(["plan", "--manifest", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model: {DEFAULT_MODEL} (30 layers, hidden 576, 9 heads / 3 kv heads")
    assert f"shardmesh coordinator --listen 0.0.0.0:50051 --model {fake_cache} " in out
